"""A layer's prefill attention for the 32 ShareGPT prompts of `bench throughput` (SmolLM2: 9 query
heads, 3 KV heads, head_dim 64; lengths from the dataset, 5,464 tokens), fresh prefills:
torch's SDPA one chunk at a time (the torch backend's path before the C kernel: 4-D inputs, flash
attention, `is_causal`) against `kvp_paged_prefill_f32` (one call, K/V read in place from a paged
cache whose blocks lie in random pool order). Interleaved, best of PASSES; GFLOP/s counts the
causal half, 4 x L(L+1)/2 x head_dim x heads per prompt. Prints a table, writes JSON.

    .venv/bin/python benchmarks/results/throughput/prefill_attention.py OUT.json
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from kvpilot.bench.datasets import sample_sharegpt_requests
from kvpilot.engine.attention import cpu_prefill
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.model_loader import load_tokenizer

H, KVH, D, BS = 9, 3, 64, 16
PASSES = int(os.environ.get("PASSES", 9))


def main() -> int:
    torch.manual_seed(0)
    lens = [r.prompt_len for r in sample_sharegpt_requests(load_tokenizer("smollm2-135m-instruct"), 32, seed=0)]
    blocks = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(blocks) + 1)[:sum(blocks)].to(torch.int32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    k_cache, v_cache = torch.randn(sum(blocks) + 1, BS, KVH, D), torch.randn(sum(blocks) + 1, BS, KVH, D)
    q = torch.randn(sum(lens), H + 2 * KVH, D)[:, :H]  # a view of the fused projection, as the model passes it
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kv = []
    for s, n in enumerate(lens):  # each prompt's own K/V, contiguous, as the torch path takes them
        idx = tables[s, :blocks[s]].long()
        kv.append((k_cache[idx].reshape(-1, KVH, D)[:n].clone(), v_cache[idx].reshape(-1, KVH, D)[:n].clone()))
    out_t, out_c = torch.empty(q.shape), torch.empty(q.shape)

    def torch_sdpa():
        for s, (k, v) in enumerate(kv):
            a, b = int(starts[s]), int(starts[s + 1])
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=D**-0.5, enable_gqa=True)
            out_t[a:b] = o[0].transpose(0, 1)

    def c_kernel():
        cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, tables, starts, seq_lens, D**-0.5, out_c)

    before, best = os.getloadavg(), {"torch_sdpa": 1e9, "c_kernel": 1e9}
    for _ in range(PASSES):
        for name, fn in (("torch_sdpa", torch_sdpa), ("c_kernel", c_kernel)):
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    gflop = sum(4 * n * (n + 1) / 2 * D * H for n in lens) / 1e9
    rows = {name: {"ms": round(s * 1e3, 2), "gflops": round(gflop / s, 1)} for name, s in best.items()}
    print(f"{'path':<12} {'ms a layer':>10} {'GFLOP/s':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['ms']:>10} {r['gflops']:>8}")
    ratio = best["torch_sdpa"] / best["c_kernel"]
    err = float((out_t - out_c).abs().max())
    print(f"torch / C: {ratio:.2f}x; max |difference| {err:.2e}; threads {torch.get_num_threads()}")
    json.dump({"cpu": detect_cpu().model_name, "threads": torch.get_num_threads(), "passes": PASSES,
               "prompt_lens": lens, "gflop_a_layer": gflop, "paths": rows, "torch_over_c": ratio,
               "max_abs_difference": err, "loadavg_before": before, "loadavg_after": os.getloadavg()},
              open(sys.argv[1], "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
