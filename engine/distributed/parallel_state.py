"""Tensor- and pipeline-parallel process groups of this rank, their collectives, and a
tally of the time spent communicating. With one rank (the default state) every collective
is the identity and no torch.distributed call is made, so the layers ask this module for
their rank and size unconditionally.

Groups (rank layout in engine/distributed/parallel_layout.py): one tensor-parallel group per pipeline
stage (contiguous ranks) for the all-reduces and the vocabulary all-gather, and one
pipeline group per tensor-parallel rank (ranks t, t+tp, ...) for the point-to-point
activations between stages.
Source: vLLM `vllm/distributed/parallel_state.py` (Megatron-LM's layout).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from kvpilot.engine.distributed.parallel_layout import RankPosition

_TP_GROUP: dist.ProcessGroup | None = None
_TP_SIZE = 1
_TP_RANK = 0
_PP_GROUP: dist.ProcessGroup | None = None
_PP_SIZE = 1
_PP_RANK = 0
_COMM_S: defaultdict[str, float] = defaultdict(float)


def init_model_parallel(position: RankPosition) -> None:
    """Creates every stage's tensor-parallel group and every pipeline group (all ranks must
    call this, in the same order, after `dist.init_process_group`) and keeps this rank's."""
    global _TP_GROUP, _TP_SIZE, _TP_RANK, _PP_GROUP, _PP_SIZE, _PP_RANK
    tp, pp = position.tp_size, position.pp_size
    for stage in range(pp):
        group = dist.new_group([stage * tp + t for t in range(tp)])
        if stage == position.pp_rank:
            _TP_GROUP = group
    for t in range(tp):
        group = dist.new_group([s * tp + t for s in range(pp)])
        if t == position.tp_rank:
            _PP_GROUP = group
    _TP_SIZE, _TP_RANK, _PP_SIZE, _PP_RANK = tp, position.tp_rank, pp, position.pp_rank


def set_tensor_parallel_group(group: dist.ProcessGroup | None, size: int, rank: int) -> None:
    """Sets this process's tensor-parallel group, size and rank directly (None, 1, 0: single
    rank). Used by `reset_model_parallel` and by tests that fake a rank of a larger group."""
    global _TP_GROUP, _TP_SIZE, _TP_RANK
    _TP_GROUP, _TP_SIZE, _TP_RANK = group, size, rank


def reset_model_parallel() -> None:
    """Back to the single-rank state (after the executor stopped its ranks)."""
    global _PP_GROUP, _PP_SIZE, _PP_RANK
    set_tensor_parallel_group(None, 1, 0)
    _PP_GROUP, _PP_SIZE, _PP_RANK = None, 1, 0


def get_tp_size() -> int:
    """Ranks in this rank's tensor-parallel group (1 when not parallel)."""
    return _TP_SIZE


def get_tp_rank() -> int:
    """This rank's index in its tensor-parallel group, in [0, get_tp_size())."""
    return _TP_RANK


def get_pp_size() -> int:
    """Pipeline stages (1 when not pipelined)."""
    return _PP_SIZE


def get_pp_rank() -> int:
    """This rank's pipeline stage, in [0, get_pp_size())."""
    return _PP_RANK


def get_pp_group() -> dist.ProcessGroup | None:
    """This rank's pipeline group (ranks t, t+tp, ... for its tp rank t); None with one rank."""
    return _PP_GROUP


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the tensor-parallel ranks (in place); identity with one rank."""
    if _TP_SIZE > 1:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=_TP_GROUP)
        _COMM_S["all_reduce"] += time.perf_counter() - t0
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates each rank's x along the last dimension; identity with one rank."""
    if _TP_SIZE == 1:
        return x
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    _COMM_S["all_gather"] += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def add_comm_seconds(kind: str, seconds: float) -> None:
    """Adds host wall time spent in one kind of communication ('p2p', 'broadcast', ...)."""
    _COMM_S[kind] += seconds


def comm_seconds(reset: bool = False) -> dict[str, float]:
    """Host wall seconds this process spent in each kind of communication since the last
    reset. Blocking calls include waiting for the slowest peer; on CUDA the collectives
    are asynchronous, so these are launch times, not transfer times."""
    out = dict(_COMM_S)
    if reset:
        _COMM_S.clear()
    return out
