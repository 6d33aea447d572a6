"""Decode attention time against the KV cache's block size (throughput README section 17): the
engine's C kernel (`kvp_paged_decode_*` of this tree, DTYPE=bfloat16 or float32), 16 sequences of
300-1,100 tokens, their blocks in random order in the pool (as decode-time allocation leaves them),
30 calls over 30 layers' caches (K/V from memory), best of REPS, block sizes interleaved. Prints
ms and GB/s of K/V per block size; the outputs must agree across block sizes (same K/V values).

    [DTYPE=bfloat16] [REPS=15] [THREADS=2] [BLOCK_SIZES=16,32,64,128] [LAYERS=30] \
        .venv/bin/python benchmarks/results/throughput/ab_block_size.py [out.json]

LAYERS=1 reads one layer's caches 30 times (K/V in the L3 cache, 17 MB in bf16) instead.
"""
import ctypes, json, os, random, sys, time

import torch

from kvpilot.engine.attention import cpu_decode
from kvpilot.engine.cpu_info import detect_cpu

THREADS = int(os.environ.get("THREADS", "2"))
torch.set_num_threads(THREADS)
DT = torch.bfloat16 if os.environ.get("DTYPE") == "bfloat16" else torch.float32
fn = getattr(cpu_decode.load(DT), cpu_decode.kernel_name("kvp_paged_decode", DT))
fn.restype = ctypes.c_int
fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
KVH, D, LAYERS = 3, 64, int(os.environ.get("LAYERS", "30"))
rng = random.Random(0)
lens = [rng.randint(300, 1100) for _ in range(16)]
q = torch.randn(len(lens), 9, D).to(DT)
values = [(torch.randn(sum(lens), KVH, D).to(DT), torch.randn(sum(lens), KVH, D).to(DT)) for _ in range(LAYERS)]
gb = sum(lens) * KVH * D * q.element_size() * 2 * 30 / 1e9  # K/V bytes of 30 calls


def layout(bs: int):
    """Caches [blocks, bs, KVH, D] per layer holding `values`, each sequence's blocks shuffled."""
    need = sum(-(-n // bs) for n in lens) + 1
    perm = list(range(1, need))
    rng.shuffle(perm)
    tables = torch.zeros(len(lens), max(-(-n // bs) for n in lens), dtype=torch.int32)
    caches = []
    for kv in values:
        k, v = torch.zeros(need, bs, KVH, D, dtype=DT), torch.zeros(need, bs, KVH, D, dtype=DT)
        caches.append((k, v))
    i = t0 = 0
    for s, n in enumerate(lens):
        for b in range(-(-n // bs)):
            tables[s, b] = perm[i]
            rows = min(bs, n - b * bs)
            for (k, v), (kv_k, kv_v) in zip(caches, values):
                k[perm[i], :rows] = kv_k[t0 + b * bs:t0 + b * bs + rows]
                v[perm[i], :rows] = kv_v[t0 + b * bs:t0 + b * bs + rows]
            i += 1
        t0 += n
    return caches, tables


sizes = [int(x) for x in os.environ.get("BLOCK_SIZES", "16,32,64,128").split(",")]
setups = {bs: layout(bs) for bs in sizes}
sl = torch.tensor(lens, dtype=torch.int32)
outs = {bs: torch.empty_like(q) for bs in sizes}
best = {bs: 1e9 for bs in sizes}
load_before = os.getloadavg()
for _ in range(int(os.environ.get("REPS", 15))):
    for bs, (caches, tables) in setups.items():
        t = time.perf_counter()
        for i in range(30):
            k, v = caches[i % LAYERS]
            fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1],
               sl.data_ptr(), outs[bs].data_ptr(), 0, len(lens), 9, KVH, D, bs, 0.125, THREADS)
        best[bs] = min(best[bs], time.perf_counter() - t)
ref = outs[sizes[0]].float()
rows = [{"block_size": bs, "ms": best[bs] * 1e3, "gb_per_s": gb / best[bs],
         "max_abs_diff_vs_first": (outs[bs].float() - ref).abs().max().item()} for bs in sizes]
for r in rows:
    print(f"| {r['block_size']} | {r['ms']:.1f} | {r['gb_per_s']:.1f} | {r['max_abs_diff_vs_first']:.2e} |")
json.dump({"dtype": str(DT), "cpu": detect_cpu().as_dict(), "threads": THREADS, "layers": LAYERS, "lens": lens, "rows": rows,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
          open(sys.argv[1] if len(sys.argv) > 1 else "ab_block_size.json", "w"), indent=1)
