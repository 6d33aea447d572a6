"""Prefill/extend attention over the paged cache against the float64 reference."""

import pytest
import torch
from paged_cases import DTYPES, HEADS, assert_close_to_ref, make_paged_batch, shuffled

from kvpilot.kernels.extend_attention import paged_extend_attention
from kvpilot.kernels.reference import paged_extend_attention_ref


def _reference(batch, q, query_start_loc, scale):
    return paged_extend_attention_ref(q.double(), batch.k_cache.double(), batch.v_cache.double(),
                                      batch.block_tables, query_start_loc, batch.seq_lens, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_extend_matches_reference_on_ragged_chunks(heads, head_dim, block_size, dtype, seed):
    # (cached tokens, new tokens): a 1-token prompt, a prompt of exactly a block, a chunk
    # of a block plus one after a cached block, a decode-like chunk after many blocks, and
    # a chunk longer than a query tile (64 rows when block_size is 32) after a ragged prefix.
    bs = block_size
    cases = shuffled([(0, 1), (0, bs), (bs, bs + 1), (3 * bs + 3, 1), (bs - 1, 2 * bs + 5)])
    ctx_lens, query_lens = zip(*cases)
    seq_lens = [c + q for c, q in cases]
    batch = make_paged_batch(seq_lens, list(query_lens), *heads, head_dim, block_size, dtype)
    batch.write_new_tokens()
    out = torch.full_like(batch.query, float("nan"))
    scale = head_dim**-0.5
    result = paged_extend_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.query_start_loc, batch.seq_lens, scale, out=out)
    assert result is out
    ref = _reference(batch, batch.query, batch.query_start_loc, scale)
    assert_close_to_ref(out, ref, dtype, seed)


def test_extend_writes_only_its_rows_when_offsets_do_not_start_at_zero(seed):
    # The backend passes query_start_loc[num_decodes:]: rows before it belong to decodes.
    head_dim = 64
    batch = make_paged_batch([9, 40, 21], [1, 1, 20], 4, 2, head_dim, 16, torch.float32)
    batch.write_new_tokens()
    out = torch.full_like(batch.query, float("nan"))
    scale = head_dim**-0.5
    paged_extend_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables[2:],
                           batch.query_start_loc[2:], batch.seq_lens[2:], scale,
                           max_query_len=20, out=out)
    assert torch.isnan(out[:2]).all(), "rows outside the chunks were written"
    ref = _reference(batch, batch.query, batch.query_start_loc, scale)
    assert_close_to_ref(out[2:], ref[2:], torch.float32, seed)


def test_extend_handles_non_power_of_two_head_dim_and_strided_q(seed):
    num_heads, num_kv_heads, head_dim = 8, 2, 80
    batch = make_paged_batch([20, 3], [7, 3], num_heads, num_kv_heads, head_dim, 16, torch.float16)
    batch.write_new_tokens()
    qkv = torch.randn(10, (num_heads + 2 * num_kv_heads) * head_dim).to(torch.float16)
    q = qkv[:, : num_heads * head_dim].view(10, num_heads, head_dim)
    assert not q.is_contiguous()
    scale = head_dim**-0.5
    out = paged_extend_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                 batch.query_start_loc, batch.seq_lens, scale)
    ref = _reference(batch, q, batch.query_start_loc, scale)
    assert_close_to_ref(out, ref, torch.float16, seed)


def test_extend_of_empty_batch_returns_empty():
    k_cache = torch.zeros(2, 16, 2, 64)
    q = torch.zeros(0, 4, 64)
    out = paged_extend_attention(q, k_cache, k_cache.clone(), torch.zeros(0, 1, dtype=torch.int32),
                                 torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                 0.125)
    assert out.shape == (0, 4, 64)
