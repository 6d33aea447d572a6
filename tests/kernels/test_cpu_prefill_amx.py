"""The bf16 prefill kernel's AMX path (kernels/cpu/csrc/prefill.c, the amx build): q.K^T and p.V on
TDPBF16PS tiles with the probabilities rounded to bf16, held to the float64 paged reference of causal
attention; and that it is the path an AMX CPU runs. Skipped, with the reason, on CPUs without AMX
(the float32 register tiles serve there: test_cpu_prefill.py, test_cpu_kernels_bf16.py)."""

import pytest
import torch
from paged_cases import make_paged_batch, rel_err

from kvpilot.kernels.cpu import prefill as cpu_prefill
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.kernels.reference import paged_extend_attention_ref

BF16 = torch.bfloat16
AMX = selected_variant() == "amx"
# Max |out - ref| / max |ref| against the float64 reference over the same bf16 q, K and V: the
# output's rounding (2^-9 relative) plus the probabilities' (2^-9 relative each, averaging out over
# the keys). Measured up to 4.0e-3 over these and other shapes (12 seeds), the float32 tiles' up to
# 3.1e-3 on the same inputs. (paged_cases'
# bf16 tolerance, 1.6e-2, also covers GPU kernels' bf16 products.)
TOLERANCE = 6e-3
# chunk lengths: every tail of the 16-position items and of the 16- and 64-key tiles, up to 5 key
# tiles; cached tokens before them: fresh prefills and extends (up to tile and block boundaries)
QUERY_LENS = [1, 5, 16, 17, 100, 300]
CACHED = [0, 0, 40, 0, 64, 131]
GROUPS = {1: (4, 4), 3: (9, 3), 4: (8, 2)}  # GQA group: (num_heads, num_kv_heads)

needs_amx = pytest.mark.skipif(not AMX, reason=f"this CPU runs the {selected_variant()} kernels: no AMX tiles "
                                               "(amx_tile and amx_bf16 in /proc/cpuinfo), the float32 tiles serve")


def _batch(query_lens, cached, heads, head_dim, block_size):
    batch = make_paged_batch([c + q for c, q in zip(cached, query_lens)], query_lens, *heads, head_dim, block_size,
                             BF16)
    batch.write_new_tokens()
    return batch


def _attend(batch, scale, fn=None):
    out = torch.full(batch.query.shape, float("nan"), dtype=BF16)
    args = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
            scale)
    if fn is None:
        return cpu_prefill.paged_prefill_attention(*args, out)
    q = batch.query
    code = fn(q.data_ptr(), q.stride(0), q.stride(1), batch.k_cache.data_ptr(), batch.v_cache.data_ptr(),
              batch.block_tables.data_ptr(), batch.block_tables.shape[1], batch.query_start_loc.data_ptr(),
              batch.seq_lens.data_ptr(), batch.seq_lens.shape[0], out.data_ptr(), out.stride(0), q.shape[1],
              batch.k_cache.shape[2], q.shape[2], batch.k_cache.shape[1], scale, 1)
    assert code == 0
    return out


def _ref(batch, scale):
    return paged_extend_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                      batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)


def _assert_close(out, ref, seed):
    bad = torch.isnan(out).any(dim=-1).nonzero().tolist()[:5]
    assert not bad, f"NaN in output rows {bad} (unwritten or stale reads), seed={seed}"
    err = rel_err(out, ref)
    assert err <= TOLERANCE, f"relative error {err:.3e} > {TOLERANCE:.0e}, seed={seed}"


@needs_amx
def test_an_amx_cpu_runs_the_tile_path():
    # kvp_prefill_amx(): the amx build, the tile state granted (Linux 5.16+); the other builds and
    # the float32 library never take it
    assert cpu_prefill.amx()
    assert not cpu_prefill.amx("avx512_bf16")
    assert not cpu_prefill.amx("x86-64-v3")


@needs_amx
def test_the_tile_path_is_what_runs_and_it_rounds_the_probabilities(seed):
    # the same call in the avx512_bf16 build (float32 register tiles, float32 probabilities) gives
    # other low bits: the amx build's result is not the float32 tiles' (while both are close to the
    # reference), so the tiles ran
    batch = _batch([100, 17], [0, 40], GROUPS[3], 64, 16)
    out, ref = _attend(batch, 0.125), _ref(batch, 0.125)
    fp32_tiles = _attend(batch, 0.125, cpu_prefill._fn(BF16, "avx512_bf16"))
    _assert_close(out, ref, seed)
    _assert_close(fp32_tiles, ref, seed)
    assert not torch.equal(out, fp32_tiles)


@needs_amx
@pytest.mark.parametrize("group", GROUPS, ids=[f"group{g}" for g in GROUPS])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: padded to 32-dim tiles, a single 16-dim p.V block
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_fresh_and_extend_chunks_match_the_float64_reference(group, head_dim, block_size, threads, seed,
                                                              monkeypatch):
    # Cache slots no sequence owns are NaN (paged_cases): a read past a sequence's end, or a packed
    # key or value not zeroed past it, shows as NaN.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    batch = _batch(QUERY_LENS, CACHED, GROUPS[group], head_dim, block_size)
    scale = head_dim**-0.5
    _assert_close(_attend(batch, scale), _ref(batch, scale), seed)


@needs_amx
def test_a_long_extend_with_strided_queries(seed):
    # 5 query positions after 2000 cached tokens (32 key tiles), q a view of a fused projection
    batch = _batch([5], [2000], GROUPS[3], 64, 16)
    qkv = torch.randn(5, 15, 64).to(BF16)
    qkv[:, :9] = batch.query
    out = torch.full(batch.query.shape, float("nan"), dtype=BF16)
    cpu_prefill.paged_prefill_attention(qkv[:, :9], batch.k_cache, batch.v_cache, batch.block_tables,
                                        batch.query_start_loc, batch.seq_lens, 0.125, out)
    _assert_close(out, _ref(batch, 0.125), seed)


@needs_amx
def test_a_maximum_that_grows_from_tile_to_tile_rescales_the_sum(seed):
    # scores rise with the key's position, so every 64-key tile holds a new row maximum: the running
    # sum and the output accumulators must be rescaled by exp(m_old - m_new) each time
    batch = _batch([300], [0], GROUPS[3], 64, 16)
    u = torch.nn.functional.normalize(torch.randn(64), dim=0)
    ramp = torch.arange(300, dtype=torch.float32)[:, None, None] * 0.02 * u
    batch.k_cache.view(-1, 3, 64)[batch.slot_mapping] = ramp.expand(300, 3, 64).to(BF16)
    batch.query[:] = (40 * u).to(BF16)
    _assert_close(_attend(batch, 0.125), _ref(batch, 0.125), seed)
