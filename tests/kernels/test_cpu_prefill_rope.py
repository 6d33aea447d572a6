"""RoPE and the cache write of prefill/extend rows in one C call (kernels/cpu/attention.py
PrefillRope over csrc/attention.c kvp_rope_cache_write_*): the rotated q is HF Llama's rotate-half
RoPE computed in float32 and rounded once to the step's dtype, the rotated k and the v land at the
rows' cache slots and nothing else in the cache changes; bad shapes are refused. The engine takes it
where the C prefill attention serves the rows (engine/attention/torch_backend.py)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.cpu import attention as cpu_decode


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] float32; cos/sin [rows, 1, half] float32 -> rotate-half RoPE in float32."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 9, 3, 64), (300, 8, 2, 128)])
def test_prefill_rope_rotates_q_and_stores_k_and_v_at_the_slots(dtype, rows, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    num_blocks, block_size = rows // 16 + 4, 16
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, 7.0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows].to(torch.int64)
    q = cpu_decode.PrefillRope(cos, sin, slots, heads)(qkv, k_cache, v_cache)
    f = qkv.float()
    assert q.dtype == dtype and q.shape == (rows, heads, head_dim)
    # bf16: one rounding of the float32 rotation, bit for bit; float32: the library's fused
    # multiply-adds (-ffast-math) may differ from torch's separate products in the last bit
    same = torch.equal if dtype == torch.bfloat16 else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    assert same(q, _rotate(f[:, :heads], cos.float(), sin.float()).to(dtype))
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    k_want = _rotate(f[:, heads:heads + kv_heads], cos.float(), sin.float()).to(dtype)
    assert same(k_flat[slots], k_want) and torch.equal(v_flat[slots], qkv[:, heads + kv_heads:])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (k_flat[untouched] == 7.0).all() and (v_flat[untouched] == 7.0).all()


def test_prefill_rope_refuses_bad_shapes():
    cos = sin = torch.zeros(4, 1, 32)
    rope = cpu_decode.PrefillRope(cos, sin, torch.arange(4), 9)
    cache = torch.zeros(2, 16, 3, 64)
    with pytest.raises(ValueError, match="PrefillRope"):
        rope(torch.zeros(5, 15, 64), cache, cache.clone())  # 5 rows for 4
    with pytest.raises(ValueError, match="PrefillRope"):
        rope(torch.zeros(4, 15, 64, dtype=torch.bfloat16), cache, cache.clone())  # dtype
    with pytest.raises(ValueError, match="PrefillRope"):
        cpu_decode.PrefillRope(cos, sin, torch.arange(3), 9)  # slots for 3 rows
