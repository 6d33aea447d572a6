"""A step's inputs as plain picklable data, for broadcasting from the driver to the other
ranks: each scheduled sequence reduced to what a rank needs to build the flattened batch
(the tokens it computes this step, its block table) plus the step's block operations; and
that flattened batch (`StepBatch`, which every rank builds alike from them).
Source: vLLM v1 `SchedulerOutput` / `NewRequestData` (what crosses the process boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.sample.prompt_logprobs import PromptRows
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.core.scheduler import SchedulerOutput


@dataclass
class StepSequence:
    """What a worker needs of a scheduled sequence: the tokens it computes this step and
    where their KV goes. Quacks like `Sequence` for `ModelRunner._prepare`."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    is_prefill: bool
    block_table: list[int]
    token_ids: list[int]  # tokens [num_computed_tokens, num_computed_tokens + scheduled)
    sampling_params: SamplingParams
    num_prompt_tokens: int  # where the prompt ends (rows with prompt logprobs lie before it)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of the sequence; only this step's tokens,
        [num_computed_tokens, num_computed_tokens + scheduled), are held."""
        base = self.num_computed_tokens
        return self.token_ids[start - base : end - base]


@dataclass
class StepInput:
    """A SchedulerOutput as picklable plain data: (sequence, num_scheduled_tokens) pairs
    and the block operations to run before the forward pass."""

    scheduled: list[tuple[StepSequence, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> StepInput:
        """The step's picklable form: each sequence reduced to a StepSequence, block lists
        copied."""
        scheduled = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            scheduled.append((StepSequence(
                seq.request_id, start, seq.num_tokens, seq.is_prefill, list(seq.block_table),
                seq.token_ids_range(start, start + n), seq.sampling_params, seq.num_prompt_tokens,
            ), n))
        return cls(scheduled, list(out.blocks_to_swap_out), list(out.blocks_to_swap_in),
                   list(out.blocks_to_copy), list(out.blocks_to_zero))

    def to_scheduler_output(self) -> SchedulerOutput:
        """A SchedulerOutput over the StepSequences, as a worker's runner takes it."""
        return SchedulerOutput(scheduled=self.scheduled, blocks_to_swap_out=self.blocks_to_swap_out,
                               blocks_to_swap_in=self.blocks_to_swap_in, blocks_to_copy=self.blocks_to_copy,
                               blocks_to_zero=self.blocks_to_zero)


class StepBatch(NamedTuple):
    """A step's flattened inputs (engine/worker/model_runner.py): the tokens' ids, positions and
    attention metadata, then logits_idx [rows] int64: the rows to project through the LM head,
    first the last row of each sequence in sample_seqs (those that sample this step), then
    prompt_rows' rows (prompt logprobs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_idx: torch.Tensor
    sample_seqs: list
    prompt_rows: PromptRows
