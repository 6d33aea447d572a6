"""torch SDPA on CPU with 3-D vs 4-D inputs, the engine's prefill/extend shapes: one sequence,
9 query heads, 3 KV heads, head_dim 64, float32, 2 threads. Prints ms per call (mean of 10
after a warm-up) and the largest difference between the variants' outputs.

    .venv/bin/python benchmarks/results/throughput/sdpa_3d_vs_4d.py > sdpa_3d_vs_4d_avx2.txt
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def ms_per_call(fn, n: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


def sdpa(q, k, v, four_d: bool, **kw):
    """q [L, 9, 64], k/v [S, 3, 64] -> [9, L, 64]; 4-D adds a batch dimension of 1."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if four_d:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kw)[0]
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def main() -> None:
    torch.set_num_threads(2)
    for n in (128, 512, 1024):
        q, k, v = torch.randn(n, 9, 64), torch.randn(n, 3, 64), torch.randn(n, 3, 64)
        causal3, causal4 = (ms_per_call(lambda d=d: sdpa(q, k, v, d, is_causal=True)) for d in (False, True))
        diff = (sdpa(q, k, v, True, is_causal=True) - sdpa(q, k, v, False, is_causal=True)).abs().max()
        # an extend: n new tokens after 64 cached ones, a boolean mask [n, n + 64]
        kk, vv = torch.randn(n + 64, 3, 64), torch.randn(n + 64, 3, 64)
        mask = torch.arange(n + 64)[None] <= torch.arange(64, n + 64)[:, None]
        ext3, ext4 = (ms_per_call(lambda d=d: sdpa(q, kk, vv, d, attn_mask=mask)) for d in (False, True))
        print(f"L={n}: causal prefill 3-D {causal3:.2f} ms, 4-D {causal4:.2f} ms (max diff {diff:.1e}); "
              f"extend with a mask 3-D {ext3:.2f} ms, 4-D {ext4:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
