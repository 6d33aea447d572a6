"""In-process A/B of the GGUF float32 path (throughput README section 14): the 121 matmuls of a
SmolLM2 decode step (distinct weights, streamed from memory), the library built from an older
revision's source against this tree's, interleaved, best of PASSES, outputs compared bit for bit.
M1=1 also times one row through the row kernel and the tiled path.

    mkdir -p /tmp/old/kvpilot && git archive 6bd9c0f~1 | tar -x -C /tmp/old/kvpilot   # the older tree
    PYTHONPATH=/tmp/old .venv/bin/python -c "from kvpilot.engine.layers import gguf_matmul_c as g; \
        open('/tmp/old.c', 'w').write(g.SOURCE)"
    .venv/bin/python benchmarks/results/throughput/ab_gguf_dequant.py /tmp/old.c 1,2,4,8,16,27,32,64
"""
import ctypes, logging, os, sys, time
import numpy as np, torch
sys.path.insert(0, "tests/kernels")
from test_gguf_matmul import random_blocks
from kvpilot.engine.cpu_build import build_library
from kvpilot.engine.layers import gguf_matmul_c
from kvpilot.engine.layers.gguf_kernel import Q4_1, Q8_0, NATIVE_FLAGS
torch.set_num_threads(2)
libs = {"old": build_library("gguf_old", open(sys.argv[1]).read(), (NATIVE_FLAGS,), logging.getLogger(), "x"),
        "new": build_library("gguf_new", gguf_matmul_c.SOURCE, (NATIVE_FLAGS,), logging.getLogger(), "x")}
i64, ptr = ctypes.c_int64, ctypes.c_void_p
for l in libs.values():
    l.kvp_gguf_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int, ctypes.c_int]
rng = np.random.default_rng(0)
shapes = [(Q4_1, 960, 576), (Q4_1, 576, 576), (Q4_1, 3072, 576), (Q4_1, 576, 1536)] * 30 + [(Q8_0, 49152, 576)]
blocks = [(q, n, k, random_blocks(q, n, k, rng)[0].contiguous()) for q, n, k in shapes]
print("load", os.getloadavg())
for m in [int(a) for a in sys.argv[2].split(",")]:
    xs = {k: torch.randn(m, k) for k in (576, 1536)}
    outs = {name: [torch.empty(m, n) for _, n, _, _ in blocks] for name in libs}
    best = {}
    for _ in range(int(os.environ.get("PASSES", 7))):
        for name, lib in libs.items():
            t = time.perf_counter()
            for (q, n, k, raw), y in zip(blocks, outs[name]):
                x = xs[k]
                lib.kvp_gguf_matmul(q, raw.data_ptr(), n, k, x.data_ptr(), k, m, y.data_ptr(), n, 2, 0)
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) * 1e3)
    same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    print(f"M={m}: old {best['old']:.1f} ms new {best['new']:.1f} ms ratio {best['new']/best['old']:.3f} identical={same}", flush=True)
print("load", os.getloadavg())
if os.environ.get("M1"):
    libs["new"].kvp_gguf_set_tiled_min_m(1)
    for m in (1,):
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        best = {}
        for _ in range(7):
            for name, lib in libs.items():
                t = time.perf_counter()
                for (q, n, k, raw) in blocks:
                    y = torch.empty(m, n); x = xs[k]
                    lib.kvp_gguf_matmul(q, raw.data_ptr(), n, k, x.data_ptr(), k, m, y.data_ptr(), n, 2, 0)
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) * 1e3)
        print("M=1 row path (old lib)", best["old"], "tiled (new lib)", best["new"])
