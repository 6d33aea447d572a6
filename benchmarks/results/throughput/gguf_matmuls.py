"""The 121 matmuls of one SmolLM2 decode step (30 x qkv [960,576], o [576,576], gate_up [3072,576],
down [576,1536] in Q4_1; the LM head [49152,576] in Q8_0) through the GGUF kernel with 8-bit
activations (q8_1, the default), with float32 activations, and torch's dense fp32 F.linear on the
same shapes, by token count M (the threshold of engine/layers/linear.py), 1 and 2 threads; the
three interleaved pass by pass, best wall time of 5 passes over all 121 (random blocks: the
kernel's time does not depend on the values). Usage: python gguf_matmuls.py OUT.json [M ...]"""
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../tests/kernels"))
from test_gguf_matmul import random_blocks
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers.gguf_kernel import Q4_1, Q8_0, gguf_matmul
rng = np.random.default_rng(0)
shapes = [(Q4_1, 960, 576), (Q4_1, 576, 576), (Q4_1, 3072, 576), (Q4_1, 576, 1536)] * 30 + [(Q8_0, 49152, 576)]
blocks = [(q, n, k, random_blocks(q, n, k, rng)[0]) for q, n, k in shapes]
dense = [torch.randn(n, k) for _, n, k in shapes]
before, rows = os.getloadavg(), []
for m in [int(a) for a in sys.argv[2:]] or (1, 4, 8):
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        best = {}
        for _ in range(5):
            for name in ("gguf_q8", "gguf", "dense"):
                t = time.perf_counter()
                if name == "dense":
                    for w in dense:
                        torch.nn.functional.linear(xs[w.shape[1]], w)
                else:
                    for q, n, k, raw in blocks:
                        gguf_matmul(xs[k], raw, q, n, activations="q8_1" if name == "gguf_q8" else "float32")
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) * 1e3)
        rows.append({"tokens": m, "threads": threads, "gguf_q8_ms": best["gguf_q8"], "gguf_ms": best["gguf"],
                     "dense_fp32_ms": best["dense"], "loadavg": os.getloadavg()[0]})
        print(rows[-1], flush=True)
json.dump({"cpu": detect_cpu().model_name, "note": "gguf_ms: float32 activations; gguf_q8_ms: 8-bit (q8_1)",
           "loadavg_before": before, "loadavg_after": os.getloadavg(), "rows": rows}, open(sys.argv[1], "w"), indent=2)
