"""The KV-cache write against the reference: exactly the mapped slots change."""

import pytest
import torch
from paged_cases import DTYPES

from kvpilot.kernels.cache_write import write_kv_cache
from kvpilot.kernels.reference import write_kv_cache_ref


def _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


def _assert_same(actual, expected):
    # Bit-exact, NaN (untouched slots) included.
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_write_puts_each_token_in_its_slot(num_kv_heads, head_dim, block_size, dtype):
    num_blocks, num_tokens = 4, 10
    k_cache, v_cache = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # Distinct random slots anywhere in the cache, plus the first and last slot, so block
    # and offset arithmetic is checked at both ends; one padding token (-1) is skipped.
    last = num_blocks * block_size - 1
    perm = torch.randperm(last + 1)
    perm = perm[(perm != 0) & (perm != last)]
    slots = torch.cat([torch.tensor([0, last, -1]), perm[: num_tokens - 3]])
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)

    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)
    written = (~torch.isnan(k_cache.float())).all(dim=(2, 3)).sum().item()
    assert written == num_tokens - 1


def test_write_casts_to_cache_dtype_and_reads_strided_views():
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 6, 4, 2, 80, 16
    k_cache, v_cache = _poisoned_caches(3, block_size, num_kv_heads, head_dim, torch.float16)
    # K and V as views into a fused float32 QKV projection.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.tensor([5, 16, 47, 0, 30, 17], dtype=torch.int32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv_cache(key, value, k_cache, v_cache, slots)
    write_kv_cache_ref(key, value, k_ref, v_ref, slots)

    _assert_same(k_cache, k_ref)
    _assert_same(v_cache, v_ref)


def test_write_of_no_tokens_changes_nothing():
    k_cache, v_cache = _poisoned_caches(2, 16, 2, 64, torch.float32)
    empty = torch.zeros(0, 2, 64)
    write_kv_cache(empty, empty, k_cache, v_cache, torch.zeros(0, dtype=torch.int64))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()
