"""A step's KV block operations, run before its forward pass writes (SchedulerOutput's order): zero the
blocks handed out for the first time (where the pool is not zero pages already: engine/cpu/zero_pages.py),
then swap-out (its device blocks may be reused by this very step), swap-in and copy-on-write copies.
Source: vLLM's v0 worker (`cache_engine.swap_in`/`swap_out`/`copy` before `execute_model`)."""

from __future__ import annotations

import torch

from kvpilot.engine.core.scheduler import SchedulerOutput

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [num_blocks, block_size, kv_heads, head_dim]


def apply(out: SchedulerOutput, kv_caches: KVCaches, swap_caches: KVCaches, zero_fresh: bool) -> None:
    """Runs `out`'s block operations on the device caches `kv_caches` and the host `swap_caches`
    (block ids index their first dimension); `zero_fresh`: zero out.blocks_to_zero first."""
    if out.blocks_to_zero and zero_fresh and kv_caches:
        fresh = torch.tensor(out.blocks_to_zero, device=kv_caches[0][0].device)
        for k, v in kv_caches:
            k.index_fill_(0, fresh, 0)
            v.index_fill_(0, fresh, 0)
    for pairs, src_caches, dst_caches in (
        (out.blocks_to_swap_out, kv_caches, swap_caches),
        (out.blocks_to_swap_in, swap_caches, kv_caches),
        (out.blocks_to_copy, kv_caches, kv_caches),
    ):
        if not pairs:
            continue
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            dk[dst.to(dk.device)] = sk[src.to(sk.device)].to(dk.device)
            dv[dst.to(dv.device)] = sv[src.to(sv.device)].to(dv.device)
