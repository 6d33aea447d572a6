"""The C prefill/extend attention for CPU (engine/attention/cpu_prefill.py) against the float64
paged reference, and its use by the torch backend for float32 chunks."""

import random

import pytest
import torch
from paged_cases import HEADS, assert_close_to_ref, make_paged_batch

from kvpilot.engine.attention import torch_backend
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import prefill as cpu_prefill
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.kernels.reference import paged_extend_attention_ref, write_kv_cache_ref

SMOLLM2 = (9, 3)  # the shipped model's heads: GQA group of 3, 48 rows per work item
# the AVX2 + FMA code is in every variant above generic (kernels/cpu/build.py); the loader picks
# generic only where the CPU lacks one of x86-64-v3's flags
AVX2 = selected_variant() != "generic"


@pytest.fixture
def kernel():
    if cpu_decode.load() is None:
        pytest.fail("the CPU kernel library did not build here (a C compiler is part of `make install`)")
    # the kernel is the AVX2 build's; elsewhere the backend keeps torch's SDPA (tested below)
    assert cpu_prefill.available() == AVX2
    if not AVX2:
        pytest.skip("no AVX2 + FMA on this CPU: the prefill kernel is not built, torch's SDPA serves")
    return cpu_prefill


def _chunks(seq_lens, query_lens, heads, head_dim, block_size):
    """A batch of chunks with their K/V written (the backend writes them before attending)."""
    batch = make_paged_batch(seq_lens, query_lens, *heads, head_dim, block_size, torch.float32)
    batch.write_new_tokens()
    return batch


def _ref(batch, scale):
    return paged_extend_attention_ref(batch.query.double(), batch.k_cache.double(), batch.v_cache.double(),
                                      batch.block_tables, batch.query_start_loc, batch.seq_lens, scale)


def _attend(kernel, batch, scale, q=None):
    out = torch.full(batch.query.shape, float("nan"))
    return kernel.paged_prefill_attention(batch.query if q is None else q, batch.k_cache, batch.v_cache,
                                          batch.block_tables, batch.query_start_loc, batch.seq_lens, scale, out)


@pytest.mark.parametrize("heads", [*HEADS.values(), SMOLLM2], ids=[*HEADS.keys(), "smollm2"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 5), (128, 1)])
@pytest.mark.parametrize("threads", [1, 3])
def test_fresh_prefills_and_extends_match_reference(kernel, heads, head_dim, block_size, threads, seed,
                                                    monkeypatch):
    # Chunks of 1 to 150 tokens after 0 to 140 cached ones: every tail of the 16-position work
    # items, of the 6-row tiles (padded rows) and of the 64- and 16-key tiles. Cache slots no
    # sequence owns are NaN, so a read past a sequence's end or through table padding shows.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rng = random.Random(seed)
    query_lens = [rng.choice([1, 2, 15, 16, 17, 64, 65, rng.randint(1, 150)]) for _ in range(5)]
    cached = [rng.choice([0, 0, 1, 63, rng.randint(0, 140)]) for _ in query_lens]
    batch = _chunks([c + q for c, q in zip(cached, query_lens)], query_lens, heads, head_dim, block_size)
    scale = head_dim**-0.5
    assert_close_to_ref(_attend(kernel, batch, scale), _ref(batch, scale), torch.float32, seed)


def test_a_maximum_that_grows_from_tile_to_tile_rescales_the_sum(kernel, seed):
    # Scores rise with the key's position (k_j = j * u, q along u), so every 64-key tile holds a new
    # row maximum: the running sum and output must be rescaled by exp(m_old - m_new) each time.
    # Skipping the rescale (or the maximum) gives a wrong or overflowing result here.
    batch = _chunks([300], [300], SMOLLM2, 64, 16)
    u = torch.nn.functional.normalize(torch.randn(64), dim=0)
    ramp = torch.arange(300, dtype=torch.float32)[:, None, None] * 0.02 * u
    slots = batch.slot_mapping
    batch.k_cache.view(-1, 3, 64)[slots] = ramp.expand(300, 3, 64)
    batch.query[:] = 40 * u
    assert_close_to_ref(_attend(kernel, batch, 0.125), _ref(batch, 0.125), torch.float32, seed)


def test_query_rows_may_be_a_strided_view_of_the_fused_projection(kernel, seed):
    batch = _chunks([40, 7], [40, 7], HEADS["gqa"], 64, 16)
    qkv = torch.randn(47, 10, 64)
    qkv[:, :6] = batch.query  # [tokens, q heads | k heads | v heads, head_dim], as the model passes it
    assert_close_to_ref(_attend(kernel, batch, 0.125, qkv[:, :6]), _ref(batch, 0.125), torch.float32, seed)


def test_bad_shapes_and_dtypes_are_refused(kernel):
    batch = _chunks([5], [5], HEADS["mha"], 24, 4)  # head_dim 24: not a multiple of 16
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        _attend(kernel, batch, 1.0)
    batch = _chunks([5], [5], HEADS["mha"], 32, 4)
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        kernel.paged_prefill_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables.long(),
                                       batch.query_start_loc, batch.seq_lens, 1.0, torch.empty_like(batch.query))
    assert not cpu_prefill.supports(batch.query.bfloat16(), batch.k_cache)
    assert not cpu_prefill.supports(torch.empty(5, 4, 24), batch.k_cache)


def _meta(batch, num_decodes):
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
        block_tables=batch.block_tables, num_decodes=num_decodes, query_start_loc_cpu=batch.query_start_loc.tolist(),
        query_lens_cpu=batch.query_lens_list, seq_lens_cpu=batch.seq_lens_list)


@pytest.mark.parametrize("path", ["forward", "forward_qkv"])
def test_backend_attends_a_steps_chunks_in_one_kernel_call_beside_decodes(kernel, path, seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 90) for _ in range(4)]
    chunks = [(0, 33), (50, 7), (16, 1)]  # fresh prefill, extend after a cached prefix, one-token chunk
    batch = make_paged_batch(lens + [c + q for c, q in chunks], [1] * 4 + [q for _, q in chunks],
                             *SMOLLM2, 64, 16, torch.float32)
    k_ref, v_ref = batch.k_cache.double(), batch.v_cache.double()
    write_kv_cache_ref(batch.key.double(), batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_extend_attention_ref(batch.query.double(), k_ref, v_ref, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, 0.125)
    meta, backend = _meta(batch, 4), TorchAttentionBackend()
    k, v = batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num()
    if path == "forward":
        out = backend.forward(batch.query, batch.key, batch.value, k, v, meta, 0.125)
    else:  # rope = identity (cos 1, sin 0): the fused decode rows and the chunks' rows share one qkv
        qkv = torch.cat((batch.query, batch.key, batch.value), dim=1)
        n = qkv.shape[0]
        out = backend.forward_qkv(qkv, (torch.ones(n, 1, 32), torch.zeros(n, 1, 32)), k, v, meta, 0.125, 9)
    prefill = meta.backend_state[torch_backend._PREFILL_KEY]
    assert isinstance(prefill, cpu_prefill.PrefillBatch) and prefill.first_row == 4
    assert_close_to_ref(out, ref, torch.float32, seed)


def test_the_backend_keeps_sdpa_for_chunks_when_the_kernel_is_off_or_not_float32(seed):
    batch = _chunks([30, 12], [30, 5], HEADS["gqa"], 64, 16)
    for backend, query in ((TorchAttentionBackend(use_cpu_kernel=False), batch.query),
                           (TorchAttentionBackend(), batch.query.double())):
        meta = _meta(batch, 0)
        backend._prefill(meta, query, batch.k_cache)
        assert meta.backend_state[torch_backend._PREFILL_KEY] is None
