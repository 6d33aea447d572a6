"""A/B of two builds of the GGUF kernel library in one process (e.g. the pthread-pool and the
OpenMP builds from ~/.cache/kvpilot/kernels): best of 10 calls of a 3072x576 Q8_0 matmul with
8-bit activations on 2 threads, m = 1, 8, 64, 512. MIX=1 runs a torch matmul between calls, as
in a step that mixes them (README section 11).

usage: ab_gguf_threads.py OLD.so NEW.so
"""
import ctypes, time, torch, sys, os
P, I = ctypes.c_void_p, ctypes.c_int64
libs = {}
for name, path in (("old", sys.argv[1]), ("new", sys.argv[2])):
    l = ctypes.CDLL(path); f = l.kvp_gguf_matmul; f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, P, I, I, P, I, I, P, I, ctypes.c_int, ctypes.c_int]; libs[name] = f
torch.set_num_threads(2)
n, k = 3072, 576
w = torch.randint(0, 255, (n, k // 32 * 34), dtype=torch.uint8)
w.view(n, k // 32, 34)[:, :, 0:2] = torch.tensor([0, 0x2c], dtype=torch.uint8)  # f16 d ~ 1/16
for m in (1, 8, 64, 512):
    x = torch.randn(m, k); y = torch.empty(m, n)
    res = {}
    for rep in range(3):
        for name, f in libs.items():
            best = 1e9
            for r in range(10):
                t = time.perf_counter(); f(8, w.data_ptr(), n, k, x.data_ptr(), k, m, y.data_ptr(), n, 2, 1); best = min(best, time.perf_counter() - t)
                torch.mm(x, x.t()) if os.environ.get("MIX") else None  # a torch OpenMP region between calls, as in a step
            res.setdefault(name, []).append(best * 1e6)
    print(f"m={m}: " + "  ".join(f"{k} {min(v):.0f} us" for k, v in res.items()), f"load {os.getloadavg()[0]:.2f}")
