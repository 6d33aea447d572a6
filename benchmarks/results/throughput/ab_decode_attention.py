"""In-process A/B of the decode attention kernel (throughput README section 14): the CPU kernel
library built from OLD.c (e.g. an older revision's `cpu_kernels_source.SOURCE`) against this tree's
(and ALT.c if given), 16 sequences of 300-1,100 tokens, 30 calls over 30 layers' caches (K/V from
memory) and over one layer's (K/V in L3), interleaved, best of REPS. DTYPE=bfloat16 builds both
with -DKVP_BF16 and runs bf16 caches (OLD.c must then be a source with the bf16 build).

    [DTYPE=bfloat16] .venv/bin/python benchmarks/results/throughput/ab_decode_attention.py OLD.c [ALT.c]
"""
import ctypes, logging, os, random, sys, time, torch
from kvpilot.engine.attention import cpu_kernels_source, cpu_decode
from kvpilot.engine.cpu_build import build_library
torch.set_num_threads(2)
srcs = {"old": open(sys.argv[1]).read(), "new": cpu_kernels_source.SOURCE}
if len(sys.argv) > 2:
    srcs["alt"] = open(sys.argv[2]).read()
BF16 = os.environ.get("DTYPE") == "bfloat16"
DT, FLAGS = (torch.bfloat16, [(["-DKVP_BF16", *cpu_decode._FLAG_SETS[0][0]], cpu_decode._FLAG_SETS[0][1])]) if BF16 \
    else (torch.float32, cpu_decode._FLAG_SETS[:1])
libs = {}
for name, src in srcs.items():
    lib = build_library("attn_" + name + ("_bf16" if BF16 else ""), src, FLAGS, logging.getLogger(), "x")
    fn = getattr(lib, "kvp_paged_decode_bf16" if BF16 else "kvp_paged_decode_f32"); fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
    libs[name] = fn
BS, KVH, D = 16, 3, 64
rng = random.Random(0)
NSEQ = int(os.environ.get("NSEQ", 16))
lens = [rng.randint(300, 1100) for _ in range(NSEQ)]
need = sum(-(-L // BS) for L in lens) + 1
caches = [(torch.randn(need, BS, KVH, D).to(DT), torch.randn(need, BS, KVH, D).to(DT)) for _ in range(30)]
perm = list(range(1, need)); rng.shuffle(perm)
tables = torch.zeros(len(lens), max(-(-L // BS) for L in lens), dtype=torch.int32); i = 0
for s, L in enumerate(lens):
    for b in range(-(-L // BS)): tables[s, b] = perm[i]; i += 1
sl = torch.tensor(lens, dtype=torch.int32); q = torch.randn(len(lens), 9, D).to(DT)
outs = {n: torch.empty_like(q) for n in libs}
gb = sum(lens) * KVH * D * q.element_size() * 2 * 30 / 1e9
for layers in (30, 1):
    best = {n: 1e9 for n in libs}
    for _ in range(int(os.environ.get("REPS", 15))):
        for name, fn in libs.items():
            t = time.perf_counter()
            for i in range(30):
                k, v = caches[i % layers]
                fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1], sl.data_ptr(), outs[name].data_ptr(), 0, len(lens), 9, 3, D, BS, 0.125, 2)
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"{layers} layer caches:", {n: f"{b*1e3:.1f} ms {gb/b:.1f} GB/s" for n, b in best.items()}, "maxdiff", (outs['old'].float() - outs['new'].float()).abs().max().item())
print(os.getloadavg())
