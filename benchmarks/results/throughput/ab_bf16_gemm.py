"""In-process A/B of a bf16 decode step's 120 layer matmuls (throughput README, Zen 4 part, section
16): oneDNN's packed bf16 matmul against engine/layers/bf16_gemm.py's AVX512_BF16 kernel, the
30 layers' qkv, o, gate_up and down weights (distinct, so streamed from memory), interleaved,
best of 7, 2 threads, at MS rows (default 1,4,8,16,24,32,64).

    [MS=1,16] .venv/bin/python benchmarks/results/throughput/ab_bf16_gemm.py
"""
import torch, time, os
from kvpilot.engine.layers import bf16_gemm
torch.set_num_threads(2)
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
layers = []
for l in range(30):
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k).bfloat16()
        layers.append((n, k, torch.ops.mkldnn._reorder_linear_weight(w, 128), bf16_gemm.pack(w)))
for M in [int(v) for v in os.environ.get("MS", "1,4,8,16,24,32,64").split(",")]:
    xs = {k: torch.randn(M, k).bfloat16() for k in (576, 1536)}
    best = {"onednn": 1e9, "ours": 1e9}
    with torch.inference_mode():
        for r in range(7):
            t = time.perf_counter()
            for n, k, pk, _ in layers: torch.ops.mkldnn._linear_pointwise(xs[k], pk, None, "none", [], "")
            best["onednn"] = min(best["onednn"], time.perf_counter() - t)
            t = time.perf_counter()
            for n, k, _, pp in layers: bf16_gemm.matmul(xs[k], pp, n)
            best["ours"] = min(best["ours"], time.perf_counter() - t)
    print(f"M={M}: onednn {best['onednn']*1e3:.1f} ms, ours {best['ours']*1e3:.1f} ms, ratio {best['onednn']/best['ours']:.2f}x")
print(os.getloadavg())
