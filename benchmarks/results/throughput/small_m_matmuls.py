"""The 121 float32 matmuls of one SmolLM2-135M step (30 layers x qkv/o/gate_up/down + LM head,
each weight distinct so the 538 MB stream from memory) at M rows: plain F.linear against
oneDNN-packed weights, best of 4, torch threads from TH (default: torch's). README section 11.

usage: TH=2 small_m_matmuls.py 1,8,16,32
"""
import torch, time, os, sys
import torch.nn.functional as F
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
W = [torch.randn(n, k) * 0.02 for n, k in shapes]
P = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in W]
params = sum(w.numel() for w in W)
torch.set_num_threads(int(os.environ.get("TH", torch.get_num_threads())))
Ms = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 4, 8, 16, 24, 32]
for M in Ms:
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    res = {}
    for name in ("plain", "packed"):
        best = 1e9
        for r in range(4):
            t = time.perf_counter()
            for (n, k), w, p in zip(shapes, W, P):
                x = xs[k]
                y = F.linear(x, w) if name == "plain" else torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            best = min(best, time.perf_counter() - t)
        res[name] = best
    print(f"M={M:3d} " + "  ".join(f"{k} {v*1e3:6.1f} ms ({params*4/v/1e9:4.1f} GB/s, {2*M*params/v/1e9:5.1f} GFLOP/s)" for k, v in res.items()), f"load {os.getloadavg()[0]:.2f}", flush=True)
