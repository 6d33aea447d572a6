"""torch SDPA on CPU with 3-D vs 4-D inputs (one sequence, 9 query heads, 3 KV heads, head_dim 64,
float32, 2 threads): the engine's prefill/extend shapes. Prints ms per call.

    .venv/bin/python benchmarks/results/throughput/sdpa_3d_vs_4d.py
"""
import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def bench(f, n=10):
    f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1000
for L in (128, 512, 1024):
    q = torch.randn(L, 9, 64); k = torch.randn(L, 3, 64); v = torch.randn(L, 3, 64)
    a = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True))
    def rep():
        kk = k.repeat_interleave(3, dim=1).transpose(0, 1); vv = v.repeat_interleave(3, dim=1).transpose(0, 1)
        return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
    b = bench(rep)
    def rep_c():
        kk = k.repeat_interleave(3, dim=1).transpose(0, 1).contiguous(); vv = v.repeat_interleave(3, dim=1).transpose(0, 1).contiguous()
        return F.scaled_dot_product_attention(q.transpose(0, 1).contiguous(), kk, vv, is_causal=True)
    c = bench(rep_c)
    # batched 4-D: [1, heads, L, d]
    def rep4():
        kk = k.repeat_interleave(3, dim=1).transpose(0, 1).unsqueeze(0); vv = v.repeat_interleave(3, dim=1).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk, vv, is_causal=True)
    d = bench(rep4)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
    print(f"L={L}: gqa {a:.2f} ms, repeat 3D {b:.2f}, repeat contiguous 3D {c:.2f}, repeat 4D {d:.2f}; maxdiff {(rep4()[0]-ref).abs().max():.2e}", flush=True)
print("4D gqa:")
for L in (128, 512, 1024):
    q = torch.randn(L, 9, 64); k = torch.randn(L, 3, 64); v = torch.randn(L, 3, 64)
    e = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True))
    # extend with a boolean mask, 4D
    nb = L + 64
    kk = torch.randn(nb, 3, 64); vv = torch.randn(nb, 3, 64)
    pos_q = torch.arange(nb - L, nb).unsqueeze(1); mask = torch.arange(nb).unsqueeze(0) <= pos_q
    f3 = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, enable_gqa=True))
    f4 = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.transpose(0, 1).unsqueeze(0), vv.transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=True))
    print(f"L={L}: 4D gqa causal {e:.2f} ms; extend mask 3D {f3:.2f}, 4D {f4:.2f}", flush=True)
