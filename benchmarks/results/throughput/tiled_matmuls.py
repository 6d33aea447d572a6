"""The 121 matmuls of one SmolLM2 decode step (30 x qkv [960,576], o [576,576], gate_up [3072,576],
down [576,1536] in Q4_1; the LM head [49152,576] in Q8_0), float32 activations and results, by rows M:
the GGUF kernel's row path (one activation row at a time; since the ninth session the portable
scalar loop, the AVX2 row kernel of section 12's table is gone), its tiled path (gguf_tiled_c.py: rows
dequantized once into a panel, register tiles of 3 x 4) and oneDNN's packed dense float32 weights
(the engine's path above GGUF_MAX_TOKENS). Each weight distinct, so every pass streams them from
memory; the three interleaved pass by pass, best of PASSES. torch threads from TH (default torch's).

usage: TH=2 tiled_matmuls.py OUT.json [M,M,...]
"""
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../tests/kernels"))
from test_gguf_matmul import random_blocks
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers.gguf_kernel import Q4_1, Q8_0, gguf_matmul, load

torch.set_num_threads(int(os.environ.get("TH", torch.get_num_threads())))
PASSES = int(os.environ.get("PASSES", 5))
rng = np.random.default_rng(0)
shapes = [(Q4_1, 960, 576), (Q4_1, 576, 576), (Q4_1, 3072, 576), (Q4_1, 576, 1536)] * 30 + [(Q8_0, 49152, 576)]
blocks, packed = [], []
for q, n, k in shapes:
    raw, weight = random_blocks(q, n, k, rng)
    blocks.append((q, n, raw))
    packed.append(torch.ops.mkldnn._reorder_linear_weight(torch.from_numpy(weight).float(), 64))
params = sum(n * k for _, n, k in shapes)
lib = load()
before, rows = os.getloadavg(), []
for m in [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else (1, 2, 4, 8, 16, 32, 64):
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    best = {}
    for _ in range(PASSES):
        for name in ("row", "tiled", "onednn"):
            lib.kvp_gguf_set_tiled_min_m(1 if name == "tiled" else 1 << 30)
            t = time.perf_counter()
            if name == "onednn":
                for (_, n, k), p in zip(shapes, packed):
                    torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "")
            else:
                for q, n, raw in blocks:
                    gguf_matmul(xs[raw.shape[1] // (20 if q == Q4_1 else 34) * 32], raw, q, n, activations="float32")
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) * 1e3)
    row = {"tokens": m, **{f"{k}_ms": round(v, 2) for k, v in best.items()},
           "tiled_gflops": round(2 * m * params / best["tiled"] / 1e6, 1), "loadavg": os.getloadavg()[0]}
    rows.append(row)
    print(row, flush=True)
lib.kvp_gguf_set_tiled_min_m(2)
json.dump({"cpu": detect_cpu().model_name, "threads": torch.get_num_threads(), "passes": PASSES,
           "loadavg_before": before, "loadavg_after": os.getloadavg(), "rows": rows}, open(sys.argv[1], "w"), indent=2)
