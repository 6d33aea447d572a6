"""Writing a step's new K/V into the paged cache (vLLM's `reshape_and_cache`).

One program per token copies all of its KV heads at once: the tile is
[num_kv_heads, head_dim], a few KiB, so every program does one contiguous read of the
token's K and V rows and two scattered row writes into its cache slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache_pair,
    check_devices,
    check_dtype,
    check_shape,
    is_interpreted,
)

_FN = "write_kv_cache"


@triton.jit
def _write_kv_cache_kernel(
    Key, Value, K_cache, V_cache, Slot_mapping,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slot_mapping + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(Key + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(Value + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    dst = (block_id * stride_cb + offset * stride_co
           + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd)
    tl.store(K_cache + dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + dst, v.to(V_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's K and V into its cache slot, in place.

    key, value:   [num_tokens, num_kv_heads, head_dim], float16/bfloat16/float32 (any
                  strides, e.g. views into a fused QKV projection)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache likewise),
                  float16/bfloat16/float32; values are cast to the cache's dtype
    slot_mapping: [num_tokens] int32/int64, flat slot block_id * block_size + offset;
                  a negative slot skips its token (padding). Slots must be distinct and
                  < num_blocks * block_size (not checked: that would need a device sync).
    Raises ValueError on mismatched shapes or dtypes, or tensors on different devices or
    on a device the kernel cannot run on.
    Source: vLLM PagedAttention (SOSP'23), its `reshape_and_cache` cache write.
    """
    _, block_size, num_kv_heads, head_dim = check_cache_pair(_FN, k_cache, v_cache)
    layout = "[num_tokens, num_kv_heads, head_dim]"
    check_shape(_FN, "key", key, (None, num_kv_heads, head_dim), layout)
    num_tokens = key.shape[0]
    check_shape(_FN, "value", value, (num_tokens, num_kv_heads, head_dim), layout)
    check_shape(_FN, "slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")
    check_dtype(_FN, "key", key, FLOAT_DTYPES)
    check_dtype(_FN, "value", value, FLOAT_DTYPES)
    check_dtype(_FN, "slot_mapping", slot_mapping, INDEX_DTYPES)
    check_devices(_FN, is_interpreted(_write_kv_cache_kernel), key=key, value=value,
                  k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
