"""Prompt logprobs (vLLM's `prompt_logprobs`): for a request that asks, the model's raw
distribution (log_softmax of the unprocessed logits) at every prompt position, as the prompt
token's logprob and rank and the N most likely tokens' logprobs.

The hidden state at prompt position p predicts prompt token p + 1, so a prompt of P tokens
has P - 1 rows of logprobs (position 0 of the answer is None). Only the rows of requests that
ask are projected through the LM head (`PromptRows`: they follow the rows to sample in the
step's logits), so a step where nobody asks costs nothing more; under chunked prefill each
chunk gives its own rows, and a request that asks never reads the prefix cache
(`Sequence.skip_reading_prefix_cache`), so every position is computed. The driver (rank 0)
turns its rows' logits into `PromptLogprobsChunk`s, and the engine writes them into the
request's `prompt_logprobs` by position (a recompute after preemption overwrites them).

Source: vLLM `vllm/v1/worker/gpu_model_runner.py` (`_get_prompt_logprobs_dict`),
`vllm/v1/sample/sampler.py` (`gather_logprobs`: rank = how many tokens have a logprob >= the
prompt token's), `vllm/logprobs.py` (`append_logprobs_for_next_position`: the prompt token
first, then the top N with ranks 1..N).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvpilot.engine.outputs import Logprob


@dataclass
class PromptLogprobsChunk:
    """Prompt logprobs of one request's positions [first_position, first_position + n), as
    plain lists. token_ids [n][1 + N]: the next prompt token, then the top N (N = the
    request's prompt_logprobs; the vocabulary for -1); logprobs [n][1 + N] float; ranks [n]:
    the next prompt token's rank (1 = most likely)."""

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def write_into(self, prompt_logprobs: list[dict[int, Logprob] | None]) -> None:
        """Sets prompt_logprobs[p + 1] (the distribution that predicted prompt token p + 1)
        for each position p of the chunk: {token id: Logprob}, the prompt token first."""
        for i, (ids, values, rank) in enumerate(zip(self.token_ids, self.logprobs, self.ranks)):
            ranks = [rank, *range(1, len(ids))]
            prompt_logprobs[self.first_position + i + 1] = {
                t: Logprob(v, r) for t, v, r in zip(ids, values, ranks)}


@dataclass
class PromptRows:
    """The rows of one step's flattened batch whose logits give prompt logprobs, request by
    request: `row_index` [rows] (indices into the batch's tokens), and per request its
    sequence, first position, row count and N (-1: the vocabulary)."""

    row_index: list[int] = field(default_factory=list)
    requests: list[tuple[object, int, int, int]] = field(default_factory=list)

    def add(self, seq, start: int, end: int, row_offset: int) -> None:
        """Adds `seq`'s rows among its scheduled positions [start, end), whose first is row
        `row_offset` of the batch: the positions p < num_prompt_tokens - 1 (the last prompt
        token predicts the first output token, which the sampler gives)."""
        stop = min(end, seq.num_prompt_tokens - 1)
        if stop > start:
            self.row_index.extend(range(row_offset, row_offset + stop - start))
            self.requests.append((seq, start, stop - start, seq.sampling_params.prompt_logprobs))

    def __len__(self) -> int:
        return len(self.row_index)

    def compute(self, logits: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        """logits: [len(self), vocab] (any float dtype), in row_index order. Returns
        {request_id: PromptLogprobsChunk}. Needs the driver's sequences (their
        prompt_token_ids give the tokens each row predicts)."""
        out: dict[str, PromptLogprobsChunk] = {}
        row = 0
        for seq, first, count, num_logprobs in self.requests:
            logprobs = logits[row: row + count].float().log_softmax(dim=-1)
            row += count
            targets = torch.tensor(seq.prompt_token_ids[first + 1: first + count + 1], dtype=torch.int64,
                                   device=logprobs.device).unsqueeze(1)
            token_ids, values, ranks = gather_logprobs(logprobs, num_logprobs, targets)
            out[seq.request_id] = PromptLogprobsChunk(first, token_ids.tolist(), values.tolist(), ranks.tolist())
        return out


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, targets: torch.Tensor):
    """logprobs [rows, vocab] float32, targets [rows, 1] int64, num_logprobs N >= 0 or -1 (the
    vocabulary). Returns token ids [rows, 1 + N] int64 (the target first, then the top N),
    their logprobs [rows, 1 + N] float32 and the targets' ranks [rows] int64, where rank is how
    many tokens have a logprob >= the target's (vLLM's `Sampler.gather_logprobs`). On CPU the
    ranks are counted by numpy: 15 ms for 511 x 49,152 against torch's 128 ms (2-core Zen 4)."""
    k = logprobs.shape[-1] if num_logprobs == -1 else num_logprobs
    top_values, top_ids = logprobs.topk(k, dim=-1)
    target_values = logprobs.gather(-1, targets)
    if logprobs.device.type == "cpu":
        ranks = torch.from_numpy(np.count_nonzero(logprobs.numpy() >= target_values.numpy(), axis=1).astype(np.int64))
    else:
        ranks = (logprobs >= target_values).sum(-1)
    return torch.cat((targets, top_ids), dim=1), torch.cat((target_values, top_values), dim=1), ranks


def record_prompt_logprobs(scheduled, chunks: dict[str, PromptLogprobsChunk]) -> None:
    """Writes a step's chunks into its scheduled sequences' `prompt_logprobs` (scheduled:
    [(Sequence, num_scheduled_tokens)], the step's SchedulerOutput.scheduled)."""
    for seq, _ in scheduled if chunks else ():
        chunk = chunks.get(seq.request_id)
        if chunk is not None and seq.prompt_logprobs is not None:
            chunk.write_into(seq.prompt_logprobs)
