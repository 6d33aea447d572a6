"""Paged decode attention (split-KV, GQA) against the float64 reference."""

import pytest
import torch
from paged_cases import DTYPES, HEADS, assert_close_to_ref, make_paged_batch, shuffled

from kvpilot.kernels.decode_attention import choose_num_kv_splits, paged_decode_attention
from kvpilot.kernels.reference import paged_decode_attention_ref


def _run_decode(seq_lens, heads, head_dim, block_size, dtype, seed, num_kv_splits=None, q=None):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads,
                             head_dim, block_size, dtype)
    batch.write_new_tokens()
    q = batch.query if q is None else q
    out = torch.full_like(batch.query, float("nan"))
    scale = head_dim**-0.5
    result = paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, scale, num_kv_splits=num_kv_splits, out=out)
    assert result is out
    ref = paged_decode_attention_ref(q.double(), batch.k_cache.double(), batch.v_cache.double(),
                                     batch.block_tables, batch.seq_lens, scale)
    assert_close_to_ref(out, ref, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_decode_matches_reference_on_ragged_lengths(heads, head_dim, block_size, dtype, seed):
    # 1 token, exactly a block, a block plus one, many blocks (more than one KV tile);
    # two splits also exercise the merge, with an empty second split for the 1-token one.
    seq_lens = shuffled([1, block_size, block_size + 1, 4 * block_size + 3])
    _run_decode(seq_lens, heads, head_dim, block_size, dtype, seed, num_kv_splits=2)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_split_kv_merge_matches_reference(num_kv_splits, dtype, seed):
    # Uneven splits, and with 16 splits most splits of the short sequences are empty.
    seq_lens = shuffled([2, 17, 150, 300])
    _run_decode(seq_lens, HEADS["gqa"], 64, 16, dtype, seed, num_kv_splits=num_kv_splits)


def test_decode_handles_non_power_of_two_head_dim_and_strided_q(seed):
    num_heads, num_kv_heads, head_dim = 8, 2, 80
    # q as a view into a fused QKV projection: row stride larger than num_heads * head_dim.
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float16)
    q = qkv[:, : num_heads * head_dim].view(3, num_heads, head_dim)
    assert not q.is_contiguous()
    _run_decode([5, 33, 16], (num_heads, num_kv_heads), head_dim, 16, torch.float16, seed,
                num_kv_splits=2, q=q)


def test_decode_auto_split_count_fills_the_gpu_within_limits():
    # A long context over few sequences is split; a full GPU's worth of sequences is not.
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192) == 16
    assert choose_num_kv_splits(num_seqs=2, num_kv_heads=8, max_seq_len=1000) == 4
    assert choose_num_kv_splits(num_seqs=64, num_kv_heads=8, max_seq_len=8192) == 1
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1) == 1
    # Rounded up to a power of two (one compiled variant per count).
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=3 * 256) == 4
    assert choose_num_kv_splits(num_seqs=1, num_kv_heads=8, max_seq_len=0) == 1


def test_decode_auto_splits_without_host_max_len(seed):
    _run_decode([300, 7], HEADS["mha"], 64, 32, torch.float32, seed, num_kv_splits=None)


def test_decode_of_empty_batch_returns_empty():
    k_cache = torch.zeros(2, 16, 2, 64)
    q = torch.zeros(0, 4, 64)
    out = paged_decode_attention(q, k_cache, k_cache.clone(), torch.zeros(0, 1, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 0.125)
    assert out.shape == (0, 4, 64)
