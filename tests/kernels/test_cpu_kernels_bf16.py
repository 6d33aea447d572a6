"""The bfloat16 build of the CPU kernel library (`-DKVP_BF16`: activations, norm weights and the
KV cache stored as bf16, all math in float32; kernels/cpu/csrc/kvp.h), which a bf16
engine runs (`--dtype auto` is bf16 on CPUs with AVX512_BF16 or AMX, engine/cpu/info.py).

The bf16 kernels run the float32 build's arithmetic on the widened values and round once when
they store, so the checks are: against the float32 build on the same (bf16-valued) inputs,
output for output after rounding; against the float64 paged reference within bf16's tolerance;
and, for RMSNorm and SiLU-and-mul, against the torch path, whose rounding points (HF Llama's)
the C code keeps. Unused cache slots are NaN (paged_cases), so a stray read shows."""

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from paged_cases import HEADS, assert_close_to_ref, make_paged_batch

from kvpilot.engine.attention import torch_backend
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import prefill as cpu_prefill
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.kernels.cpu import norm_act as cpu_ops
from kvpilot.engine.layers.activation import SiluAndMul
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding
from kvpilot.kernels.reference import paged_decode_attention_ref, paged_extend_attention_ref

BF16 = torch.bfloat16
# the AVX2 + FMA code is in every variant above generic (kernels/cpu/build.py); the loader picks
# generic only where the CPU lacks one of x86-64-v3's flags
AVX2 = selected_variant() != "generic"


@pytest.fixture
def kernel():
    if cpu_decode.load(BF16) is None:
        pytest.fail("the bf16 CPU kernel library did not build here (a C compiler is part of `make install`)")
    return cpu_decode


def _as_float32(batch):
    """The same batch with its K/V caches and q/k/v widened to float32 (exactly the bf16 values)."""
    return dataclasses.replace(batch, **{name: getattr(batch, name).float()
                                         for name in ("k_cache", "v_cache", "query", "key", "value")})


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 5)])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_attention_is_the_float32_kernels_result_rounded(kernel, heads, head_dim, block_size, threads,
                                                                seed, monkeypatch):
    monkeypatch.setattr(cpu_decode, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, block_size + 1, 300, rng.randint(1, 200)]) for _ in range(7)]
    batch = make_paged_batch(lens, [1] * len(lens), *heads, head_dim, block_size, BF16)
    batch.write_new_tokens()
    f32 = _as_float32(batch)
    scale = head_dim**-0.5
    out = torch.full(batch.query.shape, float("nan"), dtype=BF16)
    kernel.paged_decode_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, scale, out)
    want = kernel.paged_decode_attention(f32.query, f32.k_cache, f32.v_cache, f32.block_tables, f32.seq_lens,
                                         scale, torch.empty(f32.query.shape))
    ref = paged_decode_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, scale)
    assert_close_to_ref(out, ref, BF16, seed)
    # float32 math on the same values; only the final rounding differs (at most one bf16 ulp
    # where the compiler vectorized the widening loads differently)
    torch.testing.assert_close(out.float(), want.to(BF16).float(), rtol=2**-7, atol=1e-6)


def test_fused_decode_stores_rounded_rotations_and_attends_over_them(kernel, seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 150) for _ in range(5)]
    batch = make_paged_batch(lens, [1] * len(lens), *HEADS["gqa"], 64, 16, BF16)
    cos, sin = RotaryEmbedding(64, 4096, 10000.0).cos_sin(torch.tensor([n - 1 for n in lens]), BF16)
    qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
    f_k, f_v = batch.k_cache.float(), batch.v_cache.float()
    f_fused = cpu_decode.FusedDecode(cos.float(), sin.float(), batch.slot_mapping, batch.block_tables,
                                     batch.seq_lens, batch.seq_lens_list, 6, 0.125)
    f_fused(qkv.float(), f_k, f_v)
    fused = cpu_decode.FusedDecode(cos, sin, batch.slot_mapping, batch.block_tables, batch.seq_lens,
                                   batch.seq_lens_list, 6, 0.125)
    out = fused(qkv, batch.k_cache, batch.v_cache)
    assert out.dtype == BF16
    # the new tokens' rotated K is the float32 kernel's, rounded; V is copied as is
    assert torch.equal(batch.k_cache.isnan(), f_k.isnan())
    assert torch.equal(batch.k_cache.nan_to_num(), f_k.nan_to_num().to(BF16))
    assert torch.equal(batch.v_cache.nan_to_num(), f_v.nan_to_num().to(BF16))
    # the attention reads the stored (rounded) K: the float64 reference over the bf16 cache
    q_rot = torch.empty_like(batch.query, dtype=torch.float64)
    half = 32
    q, c, s = batch.query.double(), cos.double(), sin.double()
    q_rot[..., :half] = q[..., :half] * c - q[..., half:] * s
    q_rot[..., half:] = q[..., half:] * c + q[..., :half] * s
    ref = paged_decode_attention_ref(q_rot, batch.k_cache.double(), batch.v_cache.double(), batch.block_tables,
                                     batch.seq_lens, 0.125)
    assert_close_to_ref(out, ref, BF16, seed)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 5)])
def test_prefill_attention_is_the_float32_kernels_result_rounded(kernel, head_dim, block_size, seed):
    # the prefill kernel is the AVX2 + FMA build's; elsewhere it refuses and the backend keeps
    # torch's SDPA (test_backend_serves_a_bf16_steps_decodes_and_chunks_in_c checks that path)
    assert cpu_prefill.available(BF16) == AVX2
    if not AVX2:
        with pytest.raises(RuntimeError, match="not available"):
            cpu_prefill.paged_prefill_attention(torch.zeros(1, 9, 64, dtype=BF16), *(torch.zeros(1, 16, 3, 64,
                                                dtype=BF16),) * 2, torch.zeros(1, 1, dtype=torch.int32),
                                                torch.tensor([0, 1], dtype=torch.int32),
                                                torch.tensor([1], dtype=torch.int32), 1.0,
                                                torch.empty(1, 9, 64, dtype=BF16))
        return
    rng = random.Random(seed)
    query_lens = [rng.choice([1, 16, 17, 65, rng.randint(1, 150)]) for _ in range(4)]
    cached = [rng.choice([0, 1, rng.randint(0, 140)]) for _ in query_lens]
    batch = make_paged_batch([c + q for c, q in zip(cached, query_lens)], query_lens, 9, 3, head_dim,
                             block_size, BF16)
    batch.write_new_tokens()
    f32, scale = _as_float32(batch), head_dim**-0.5
    args = (batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)
    out = cpu_prefill.paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, *args,
                                              torch.full(batch.query.shape, float("nan"), dtype=BF16))
    want = cpu_prefill.paged_prefill_attention(f32.query, f32.k_cache, f32.v_cache, *args,
                                               torch.empty(f32.query.shape))
    ref = paged_extend_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(), *args)
    assert_close_to_ref(out, ref, BF16, seed)
    if cpu_prefill.amx():
        # the AMX path rounds the probabilities to bf16 before p.V (test_cpu_prefill_amx.py): its
        # results differ from the float32 kernel's beyond the output's rounding, and are held to
        # the float64 reference within bf16's tolerance (above) instead
        return
    torch.testing.assert_close(out.float(), want.to(BF16).float(), rtol=2**-7, atol=1e-6)


def test_backend_serves_a_bf16_steps_decodes_and_chunks_in_c(kernel, seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 90) for _ in range(4)]
    chunks = [(0, 33), (50, 7)]
    batch = make_paged_batch(lens + [c + q for c, q in chunks], [1] * 4 + [q for _, q in chunks], 9, 3, 64, 16, BF16)
    meta = AttentionMetadata(
        slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, num_decodes=4, query_start_loc_cpu=batch.query_start_loc.tolist(),
        query_lens_cpu=batch.query_lens_list, seq_lens_cpu=batch.seq_lens_list)
    k, v = batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num()
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, k, v, meta, 0.125)
    decodes, _ = meta.backend_state[torch_backend._PLAN_KEY]
    assert [g.block_ids for g in decodes] == [None]  # one C call for the decodes, no gather
    assert (meta.backend_state[torch_backend._PREFILL_KEY] is not None) == AVX2
    ref = paged_extend_attention_ref(batch.query.double(), k.double(), v.double(), batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, 0.125)
    assert out.dtype == BF16
    assert_close_to_ref(out, ref, BF16, seed)


def _nearly_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for a few values (< 1 %) whose rounded intermediate (the normalized value,
    silu(gate)) sits one bf16 step away: at most 2**-7 relative, plus each side's final
    rounding (2**-8 each)."""
    assert got.dtype == want.dtype == BF16
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=0)


@pytest.mark.parametrize("rows", [3, 200])  # 200 x 576: rows shared out over the OpenMP team
def test_rms_norm_and_silu_mul_round_where_the_torch_path_rounds(kernel, rows, seed):
    # HF Llama in bf16: residual + x rounded, the normalized row rounded before the weight,
    # silu(gate) rounded before the product with up; the C code rounds at the same points. The
    # float values before rounding differ in their last bits (the sum of squares in another
    # order; glibc's vector expf against Sleef's), which moves a few rounded values by a step.
    torch.manual_seed(seed)
    norm = RMSNorm(576, 1e-5, BF16)
    norm.weight.data.normal_()
    x, res = torch.randn(rows, 576, dtype=BF16) * 3, torch.randn(rows, 576, dtype=BF16)
    assert cpu_ops.usable(x)
    _nearly_equal(norm(x.clone()), norm._torch(x))
    want_res = x + res
    got, got_res = norm(x.clone(), res)
    assert got_res is res and torch.equal(res, want_res)  # one rounding of an exact float sum
    _nearly_equal(got, norm._torch(want_res))
    gate_up = torch.randn(rows, 2 * 1536, dtype=BF16) * 4
    _nearly_equal(SiluAndMul()(gate_up), F.silu(gate_up[:, :1536]) * gate_up[:, 1536:])
