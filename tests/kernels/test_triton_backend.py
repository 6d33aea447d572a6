"""The Triton attention backend on a mixed step (decodes, then prefill/extend chunks)
against the float64 reference and the engine's torch backend."""

import pytest
import torch
from paged_cases import DTYPES, HEADS, TOLERANCE, assert_close_to_ref, make_paged_batch, rel_err

from kvpilot.engine.attention import get_attn_backend
from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
from kvpilot.kernels.reference import paged_extend_attention_ref, write_kv_cache_ref


def _meta(batch, num_decodes) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        num_decodes=num_decodes,
        query_start_loc_cpu=batch.query_start_loc.tolist(),
        query_lens_cpu=batch.query_lens_list,
        seq_lens_cpu=batch.seq_lens_list,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_backend_matches_reference_and_torch_backend_on_a_mixed_step(heads, dtype, seed):
    head_dim, bs = 64, 16
    # Decodes (1 new token over 1, bs and 2bs + 2 cached tokens), then a fresh prefill,
    # an extend after a cached prefix block, and a chunk after a ragged prefix.
    cases = [(1, 1), (bs, 1), (2 * bs + 2, 1), (0, 5), (bs, 7), (3, bs + 3)]
    seq_lens = [c + q for c, q in cases]
    query_lens = [q for _, q in cases]
    batch = make_paged_batch(seq_lens, query_lens, *heads, head_dim, bs, dtype)
    meta = _meta(batch, num_decodes=3)
    scale = head_dim**-0.5

    k_ref, v_ref = batch.k_cache.double(), batch.v_cache.double()
    write_kv_cache_ref(batch.key.double(), batch.value.double(), k_ref, v_ref, batch.slot_mapping)
    ref = paged_extend_attention_ref(batch.query.double(), k_ref, v_ref, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, scale)

    # The Triton kernels never load past a sequence, so they get NaN-poisoned caches. The
    # torch backend relies on the engine's contract that every pool slot is finite (blocks
    # are zeroed at first use) and masks only the scores: give it finite garbage there.
    k_torch, v_torch = (torch.where(c.isnan(), 100 * torch.randn_like(c), c)
                        for c in (batch.k_cache, batch.v_cache))
    backend = get_attn_backend("triton")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    out = backend.forward(batch.query, batch.key, batch.value, batch.k_cache, batch.v_cache,
                          meta, scale)

    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close_to_ref(out, ref, dtype, seed)
    torch.testing.assert_close(batch.k_cache.double(), k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache.double(), v_ref, rtol=0, atol=0, equal_nan=True)

    expected = get_attn_backend("torch").forward(batch.query, batch.key, batch.value,
                                                 k_torch, v_torch, meta, scale)
    assert not expected.isnan().any()
    assert_close_to_ref(expected, ref, dtype, seed)
    assert rel_err(out, expected) <= 2 * TOLERANCE[dtype], f"seed={seed}"


def test_backend_runs_decode_only_and_prefill_only_steps(seed):
    head_dim = 64
    for cases, num_decodes in (([(4, 1), (20, 1)], 2), ([(0, 9), (0, 3)], 0)):
        batch = make_paged_batch([c + q for c, q in cases], [q for _, q in cases],
                                 *HEADS["gqa"], head_dim, 16, torch.float32)
        meta = _meta(batch, num_decodes)
        out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value,
                                               batch.k_cache, batch.v_cache, meta, head_dim**-0.5)
        batch_ref = batch.k_cache.double(), batch.v_cache.double()
        ref = paged_extend_attention_ref(batch.query.double(), *batch_ref, batch.block_tables,
                                         batch.query_start_loc, batch.seq_lens, head_dim**-0.5)
        assert_close_to_ref(out, ref, torch.float32, seed)
