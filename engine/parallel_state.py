"""Tensor/pipeline parallel groups. Today the engine runs one rank (world size 1); the
layers already ask this module for their rank and size and call its collectives, so the
parallelism issue adds process groups here and changes no model or scheduler code.
Source: vLLM `vllm/distributed/parallel_state.py` (Megatron-LM's layout)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_TP_SIZE = 1
_TP_RANK = 0


def set_tensor_parallel_group(group: dist.ProcessGroup | None, size: int, rank: int) -> None:
    global _TP_GROUP, _TP_SIZE, _TP_RANK
    _TP_GROUP, _TP_SIZE, _TP_RANK = group, size, rank


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_rank() -> int:
    return _TP_RANK


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the tensor-parallel ranks (in place); identity with one rank."""
    if _TP_SIZE > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates each rank's x along the last dimension; identity with one rank."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)
