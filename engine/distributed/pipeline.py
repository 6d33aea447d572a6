"""Pipeline-parallel plumbing: the step's micro-batches and the point-to-point transfers
between stages.

Micro-batches: a step's scheduled sequences are cut into contiguous runs of about equal
token counts. Sequences of one step are independent (each attends only to its own KV;
prefix-cache hits are blocks computed in earlier steps), so stage s can run micro-batch
m+1 while stage s+1 runs micro-batch m: GPipe's schedule (Huang et al., 2019) applied to
one inference step. The scheduler is unchanged. A step is cut only when every piece keeps
at least `min_tokens` tokens (`MicroBatchPolicy`): a small decode step costs about as much
per op whatever its rows, so cutting it multiplies the ops and the weight reads and loses
more than the overlap wins (measured: benchmarks/results/parallel/README.md).

Transfers (torch.distributed isend/irecv on the pipeline group: gloo on CPU, NCCL on GPU):

    stage s, tp rank t ──IntermediateTensors (hidden_states [T_m, H], model dtype)──> stage s+1, tp rank t
    last stage, tp rank 0 ──logits [n_m, vocab] float32 (rows to sample)──> rank 0 (driver)

Receivers know every shape from the step's inputs, so nothing but the tensors travels.
Tags keep micro-batches apart (gloo matches on them; NCCL keeps issue order).
Source: vLLM `vllm/distributed/parallel_state.py` (`send_tensor_dict`/`recv_tensor_dict`
between pipeline ranks) and `IntermediateTensors`; Huang et al., GPipe (2019).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvpilot.engine.distributed import parallel_state as ps
from kvpilot.engine.settings.env import KVPILOT_PP_MICRO_BATCHES, KVPILOT_PP_MIN_MICRO_BATCH_TOKENS

_LOGITS_TAG = 1 << 20


@dataclass(frozen=True)
class MicroBatchPolicy:
    """How many micro-batches a step is cut into: up to max_micro_batches
    (KVPILOT_PP_MICRO_BATCHES, default the number of stages), and only as many as give
    each at least min_tokens scheduled tokens (KVPILOT_PP_MIN_MICRO_BATCH_TOKENS, default
    128). Every rank applies the same policy to the same step, so they cut alike."""

    max_micro_batches: int = 1
    min_tokens: int = 128

    def __post_init__(self) -> None:
        if self.max_micro_batches < 1 or self.min_tokens < 1:
            raise ValueError(f"micro-batch limits must be >= 1, got {self.max_micro_batches} "
                             f"micro-batches and {self.min_tokens} tokens")

    @classmethod
    def from_env(cls, pipeline_parallel_size: int) -> MicroBatchPolicy:
        """Raises ValueError on a value below 1."""
        if pipeline_parallel_size == 1:
            return cls(1)
        return cls(int(os.environ.get(KVPILOT_PP_MICRO_BATCHES, pipeline_parallel_size)),
                   int(os.environ.get(KVPILOT_PP_MIN_MICRO_BATCH_TOKENS, 128)))

    def count(self, scheduled: Sequence) -> int:
        """Micro-batches for a step's [(sequence, num_tokens), ...]."""
        tokens = sum(k for _, k in scheduled)
        return max(1, min(self.max_micro_batches, len(scheduled), tokens // self.min_tokens))


def split_micro_batches(scheduled: Sequence, num_micro_batches: int) -> list[list]:
    """Cuts `scheduled` [(sequence, num_tokens), ...] into min(num_micro_batches, len)
    non-empty contiguous runs whose token counts are as even as a greedy cut at the
    k/num_micro_batches quantiles makes them. Order is kept, so decodes stay first."""
    n = max(1, min(num_micro_batches, len(scheduled)))
    total = sum(k for _, k in scheduled)
    chunks: list[list] = []
    current: list = []
    tokens = 0
    for i, item in enumerate(scheduled):
        current.append(item)
        tokens += item[1]
        chunks_left = n - len(chunks) - 1
        items_left = len(scheduled) - i - 1
        if chunks_left and (tokens * n >= total * (len(chunks) + 1) or items_left == chunks_left):
            chunks.append(current)
            current = []
    chunks.append(current)
    return chunks


class _Pending:
    """Receives in flight; `wait()` returns the tensors once they arrived."""

    def __init__(self, works: list, tensors):
        self._works, self.tensors = works, tensors

    def wait(self):
        t0 = time.perf_counter()
        for work in self._works:
            work.wait()
        ps.add_comm_seconds("p2p", time.perf_counter() - t0)
        return self.tensors


class StageLink:
    """This rank's point-to-point links: from the previous stage, to the next one, and
    (last stage's tp rank 0 -> driver) the logits. Sends are asynchronous; `flush()` waits
    for them (call it before the step's buffers go away)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self._sends: list = []

    def recv_intermediate(self, shapes: dict, micro_batch: int) -> _Pending:
        """Posts the receives of one micro-batch's IntermediateTensors (shapes: name ->
        (shape, dtype), as `LlamaForCausalLM.intermediate_shapes` gives)."""
        tensors, works = {}, []
        for i, (name, (shape, dtype)) in enumerate(sorted(shapes.items())):
            tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(tensors[name], src=self.prev_rank, group=ps.get_pp_group(),
                                    tag=micro_batch * 16 + i))
        return _Pending(works, tensors)

    def send_intermediate(self, tensors: dict[str, torch.Tensor], micro_batch: int) -> None:
        """Posts asynchronous sends of one micro-batch's IntermediateTensors (name -> tensor,
        e.g. hidden_states [T_m, H]) to the next stage, tagged by micro-batch; `flush()` waits."""
        t0 = time.perf_counter()
        for i, name in enumerate(sorted(tensors)):
            tensor = tensors[name].contiguous()
            self._sends.append((dist.isend(tensor, dst=self.next_rank, group=ps.get_pp_group(),
                                           tag=micro_batch * 16 + i), tensor))
        ps.add_comm_seconds("p2p", time.perf_counter() - t0)

    def recv_logits(self, src: int, num_rows: int, vocab_size: int, micro_batch: int) -> _Pending:
        """Posts the receive of one micro-batch's logits from `src` (the last stage's tp rank 0):
        [num_rows, vocab_size] float32 on this rank's device; `wait()` on the result returns them."""
        logits = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=self.device)
        work = dist.irecv(logits, src=src, group=ps.get_pp_group(), tag=_LOGITS_TAG + micro_batch)
        return _Pending([work], logits)

    def send_logits(self, logits: torch.Tensor, micro_batch: int) -> None:
        """Posts the asynchronous send of one micro-batch's logits ([rows to sample, vocab],
        float32) to the driver (rank 0); `flush()` waits."""
        t0 = time.perf_counter()
        logits = logits.contiguous()
        self._sends.append((dist.isend(logits, dst=0, group=ps.get_pp_group(),
                                       tag=_LOGITS_TAG + micro_batch), logits))
        ps.add_comm_seconds("p2p", time.perf_counter() - t0)

    def flush(self) -> None:
        """Waits for every send of this step (each buffer stays referenced until then)."""
        t0 = time.perf_counter()
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()
        ps.add_comm_seconds("p2p", time.perf_counter() - t0)
