"""The fused float32 CPU ops against their unfused references: the one-call decode side of
an attention layer (RoPE + K/V cache write + paged attention, cpu_decode.FusedDecode)
against float64 rotate-half + the reference cache writer + the float64 paged attention,
and against the torch backend's unfused path; the C RMSNorm (with vLLM's fused residual
add) and SiLU-and-mul against float64 math; and the torch fallback of each where the
library is not built. Unused cache slots are NaN (paged_cases), so a stray read shows."""

import random

import pytest
import torch
import torch.nn.functional as F
from paged_cases import HEADS, assert_close_to_ref, make_paged_batch

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.attention import torch_backend
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.kernels.cpu import norm_act as cpu_ops
from kvpilot.engine.layers.activation import SiluAndMul
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from kvpilot.engine.models.cpu_decode_stack import set_module_kernels
from kvpilot.kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref, write_kv_cache_ref


@pytest.fixture
def kernel():
    if cpu_decode.load() is None:
        pytest.fail("the CPU kernel library did not build here (a C compiler is part of `make install`)")
    return cpu_decode


def _rope(head_dim: int, positions: list[int]):
    return RotaryEmbedding(head_dim, 4096, 10000.0).cos_sin(torch.tensor(positions), torch.float32)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 5)])
@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "split-over-threads"])
def test_fused_decode_matches_rope_write_attend_reference(kernel, heads, head_dim, block_size, split, seed,
                                                          monkeypatch):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, block_size, block_size + 1, rng.randint(1, 150)]) for _ in range(7)]
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(lens, [1] * len(lens), num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    if split:
        monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_WORK", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    cos, sin = _rope(head_dim, [n - 1 + rng.randint(0, 500) for n in lens])
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
    scale = head_dim**-0.5
    # reference: float64 RoPE, the reference cache writer, float64 paged attention
    q_rot, k_rot = (apply_rotary(t.double(), (cos.double(), sin.double())) for t in (batch.query, batch.key))
    k_ref, v_ref = batch.k_cache.double(), batch.v_cache.double()
    write_kv_cache_ref(k_rot, batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_decode_attention_ref(q_rot, k_ref, v_ref, batch.block_tables, batch.seq_lens, scale)

    fused = cpu_decode.FusedDecode(cos, sin, batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                   batch.seq_lens_list, num_heads, scale)
    out = fused(qkv, batch.k_cache, batch.v_cache)
    assert_close_to_ref(out, ref, torch.float32, seed)
    # the cache now holds the rotated k and the v at the new slots, and nothing else changed
    assert_close_to_ref(batch.k_cache.view(-1, num_kv_heads, head_dim)[batch.slot_mapping], k_rot, torch.float32, seed)
    assert torch.equal(batch.v_cache.view(-1, num_kv_heads, head_dim)[batch.slot_mapping], batch.value)
    assert torch.equal(batch.k_cache.isnan(), k_ref.isnan()) and torch.equal(batch.v_cache.isnan(), v_ref.isnan())


def _mixed_qkv_step(seed, use_cpu_kernel: bool):
    """6 decodes, a fresh prefill and an extend through forward_qkv; returns the output,
    the caches after the step, the float64 reference output and the step's backend_state."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 120) for _ in range(6)]
    extends = [(0, 5), (20, 3)]
    num_heads, num_kv_heads = HEADS["gqa"]
    batch = make_paged_batch(lens + [c + q for c, q in extends], [1] * 6 + [q for _, q in extends],
                             num_heads, num_kv_heads, 64, 16, torch.float32)
    torch.manual_seed(seed)
    positions = [n - 1 for n in lens] + [p for c, q in extends for p in range(c, c + q)]
    rope = _rope(64, positions)
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
    q_rot, k_rot = (apply_rotary(t.double(), tuple(r.double() for r in rope)) for t in (batch.query, batch.key))
    k_ref, v_ref = batch.k_cache.nan_to_num().double(), batch.v_cache.nan_to_num().double()
    write_kv_cache_ref(k_rot, batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_extend_attention_ref(q_rot, k_ref, v_ref, batch.block_tables, batch.query_start_loc,
                                     batch.seq_lens, 0.125)
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, num_decodes=6, query_start_loc_cpu=batch.query_start_loc.tolist(),
        query_lens_cpu=batch.query_lens_list, seq_lens_cpu=batch.seq_lens_list)
    k_cache, v_cache = batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num()
    out = TorchAttentionBackend(use_cpu_kernel).forward_qkv(qkv, rope, k_cache, v_cache, meta, 0.125, num_heads)
    return out, (k_cache, v_cache), ref, meta.backend_state


def test_forward_qkv_fuses_the_decodes_and_matches_the_unfused_path(kernel, seed):
    out, caches, ref, state = _mixed_qkv_step(seed, use_cpu_kernel=True)
    assert isinstance(state[torch_backend._FUSED_KEY], cpu_decode.FusedDecode)
    assert_close_to_ref(out, ref, torch.float32, seed)
    out_t, caches_t, _, state_t = _mixed_qkv_step(seed, use_cpu_kernel=False)
    assert state_t[torch_backend._FUSED_KEY] is None
    assert_close_to_ref(out_t, ref, torch.float32, seed)
    for fused, unfused in zip(caches, caches_t):
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


def test_with_the_c_kernels_switched_off_every_op_takes_its_torch_path(seed, monkeypatch):
    # the kernel path of KVPILOT_CPU_KERNELS=0, set on the modules as the engine sets it; no kernel may be called
    path = cpu_kernel_path.choose(env={cpu_kernel_path.KERNELS_ENV: "0"})
    monkeypatch.setattr(cpu_decode, "load", lambda *a: pytest.fail("a C kernel was loaded"))
    out, _, ref, state = _mixed_qkv_step(seed, use_cpu_kernel=path.c_attention)
    assert state[torch_backend._FUSED_KEY] is None
    assert_close_to_ref(out, ref, torch.float32, seed)
    assert not cpu_ops.usable(torch.zeros(2, 8).double())
    x, res = torch.randn(3, 40), torch.randn(3, 40)
    norm, act = RMSNorm(40, 1e-5, torch.float32), SiluAndMul()
    set_module_kernels(torch.nn.ModuleList([norm, act]), path)
    got, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(got, F.rms_norm(x + res, (40,), norm.weight, 1e-5))
    torch.testing.assert_close(act(x[:, :40]), F.silu(x[:, :20]) * x[:, 20:])


def test_fused_decode_refuses_mismatched_metadata_and_qkv(kernel):
    batch = make_paged_batch([5, 9], [1, 1], *HEADS["gqa"], 32, 4, torch.float32)
    cos, sin = _rope(32, [4, 8])
    with pytest.raises(ValueError, match="bad metadata"):
        cpu_decode.FusedDecode(cos, sin, batch.slot_mapping.int(), batch.block_tables, batch.seq_lens,
                               [5, 9], 6, 1.0)
    fused = cpu_decode.FusedDecode(cos, sin, batch.slot_mapping, batch.block_tables, batch.seq_lens, [5, 9], 6, 1.0)
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
    with pytest.raises(ValueError, match="bad qkv"):
        fused(qkv[:, :-1], batch.k_cache, batch.v_cache)  # a missing v head
    with pytest.raises(ValueError, match="bad qkv"):
        fused(qkv.double(), batch.k_cache, batch.v_cache)
    with pytest.raises(ValueError, match="or out"):
        fused(qkv, batch.k_cache, batch.v_cache, torch.empty(2, 6, 16))  # the wrong head_dim


def test_fused_decode_writes_into_the_given_rows_of_a_step_output(kernel):
    """A mixed step passes the first rows of its output (torch_backend.forward_qkv): the decode rows
    land there, in place, and the rows after them are untouched."""
    batch = make_paged_batch([5, 9], [1, 1], *HEADS["gqa"], 32, 4, torch.float32)
    cos, sin = _rope(32, [4, 8])
    fused = cpu_decode.FusedDecode(cos, sin, batch.slot_mapping, batch.block_tables, batch.seq_lens, [5, 9], 6, 1.0)
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
    step_out = torch.full((5, 6, 32), float("nan"))
    got = fused(qkv, batch.k_cache, batch.v_cache, step_out[:2])
    assert got.data_ptr() == step_out.data_ptr() and step_out[2:].isnan().all()
    assert torch.equal(got, fused(qkv, batch.k_cache, batch.v_cache))  # the same K/V written again: same result


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


# 300 x 576: above ELEMENTWISE_PARALLEL_MIN, rows shared out over the OpenMP team (prefill-sized)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 37), (300, 576)])
def test_c_rms_norm_with_and_without_the_fused_residual_add(kernel, rows, hidden, seed):
    torch.manual_seed(seed)
    x, res, w = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden), torch.randn(hidden)
    assert cpu_ops.usable(x)
    out = cpu_ops.rms_norm(x, w, 1e-5)
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out.double(), _rms_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    x0, res0 = x.clone(), res.clone()
    out = cpu_ops.rms_norm(x, w, 1e-5, res)  # in place: res += x, x = norm(res) * w
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(res, x0 + res0)
    torch.testing.assert_close(x.double(), _rms_ref(x0 + res0, w, 1e-5), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bad shapes"):
        cpu_ops.rms_norm(x, w[:-1], 1e-5)


def test_rms_norm_module_c_path_matches_torch_and_bf16_takes_its_own_build(kernel, seed):
    torch.manual_seed(seed)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.normal_()
    x, res = torch.randn(4, 64), torch.randn(4, 64)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), rtol=1e-5, atol=1e-5)
    want_res = x + res
    want = F.rms_norm(want_res, (64,), norm.weight, 1e-6)
    got, got_res = norm(x.clone(), res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_res is res and torch.equal(res, want_res)
    bf = RMSNorm(64, 1e-6, torch.bfloat16)
    xb = torch.randn(2, 64, dtype=torch.bfloat16)
    assert cpu_ops.usable(xb)  # the bf16 build (tests/kernels/test_cpu_kernels_bf16.py)
    assert torch.equal(bf(xb), F.rms_norm(xb.float(), (64,), None, 1e-6).bfloat16())
    assert not cpu_ops.usable(xb.double())


@pytest.mark.parametrize("rows", [3, 100])  # 100 x 1536: rows shared out over the OpenMP team
def test_c_silu_and_mul_matches_float64(kernel, rows, seed):
    torch.manual_seed(seed)
    x = torch.randn(rows, 2 * 1536) * 4
    got = SiluAndMul()(x)
    g, u = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(g) * u, rtol=1e-5, atol=1e-5)
    strided = x[:, ::2]  # not contiguous: the torch path
    torch.testing.assert_close(SiluAndMul()(strided), F.silu(strided[:, :768]) * strided[:, 768:])
