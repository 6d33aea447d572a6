"""The GGUF matmul on AMX tiles (kernels/cpu/csrc/gguf_amx.c): `amx_pack`'s layout holds exactly the
blocks' values and scales (checked here against the GGUF blocks on every CPU), and where the amx build
runs with the tile state granted, matmuls in that layout equal the AVX2 8-bit path's (same integers;
float sums in another order) for 1 to 33 rows, through the tile and the VPDPBUSD paths alike. On a CPU
without AMX those matmul tests skip, and one test checks the layout is refused there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.kernels.cpu import gguf

BLOCK = {gguf.Q4_1: 20, gguf.Q8_0: 34}


def blocks(n: int, k: int, qtype: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 32, BLOCK[qtype]), dtype=torch.uint8, generator=g)
    b[:, :, 1] = 0x20  # f16 scales of moderate size (d ~ 0.01, m ~ -0.05)
    if qtype == gguf.Q4_1:
        b[:, :, 3] = 0xA0
    return b.reshape(n, -1).contiguous()


def values(b: torch.Tensor, qtype: int, k: int) -> np.ndarray:
    """[n, k] int: the blocks' 4-bit (0..15) or 8-bit (signed) values in k order."""
    blk = b.numpy().reshape(b.shape[0], k // 32, BLOCK[qtype])
    if qtype == gguf.Q4_1:
        qs = blk[:, :, 4:].astype(np.int32)
        return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(b.shape[0], k)
    return blk[:, :, 2:].view(np.int8).astype(np.int32).reshape(b.shape[0], k)


@pytest.mark.parametrize("qtype", [gguf.Q4_1, gguf.Q8_0])
def test_the_layout_holds_the_blocks_values_and_scales(qtype):
    n, k = 48, 96
    b = blocks(n, k, qtype)
    packed, layout = gguf.amx_pack(b, qtype)
    assert layout == gguf.AMX_LAYOUT[qtype] and packed.shape == b.shape
    want, blk = values(b, qtype, k), b.numpy().reshape(n, k // 32, BLOCK[qtype])
    record = 320 if qtype == gguf.Q4_1 else 544
    recs = packed.numpy().reshape(n // 16, k // 32, record)
    for t in range(n // 16):
        for blk_i in range(k // 32):
            rec = recs[t, blk_i]
            if qtype == gguf.Q4_1:
                tile = np.concatenate([rec[:256] & 15, rec[:256] >> 4]).astype(np.int32)
                scales = rec[256:].view(np.uint16).reshape(2, 16)  # d[16], m[16]
            else:
                tile = rec[:512].view(np.int8).astype(np.int32)
                scales = rec[512:].view(np.uint16).reshape(1, 16)
            # byte kk * 64 + r * 4 + j: row r's value k = 32 b + 4 kk + j
            got = tile.reshape(8, 16, 4).transpose(1, 0, 2).reshape(16, 32)
            np.testing.assert_array_equal(got, want[16 * t : 16 * t + 16, 32 * blk_i : 32 * blk_i + 32])
            np.testing.assert_array_equal(scales[0], blk[16 * t : 16 * t + 16, blk_i, :2].view(np.uint16)[:, 0])
            if qtype == gguf.Q4_1:
                np.testing.assert_array_equal(scales[1], blk[16 * t : 16 * t + 16, blk_i, 2:4].view(np.uint16)[:, 0])


def test_a_row_count_off_the_tiles_is_refused():
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        gguf.amx_pack(blocks(24, 64, gguf.Q4_1), gguf.Q4_1)


@pytest.mark.parametrize("qtype", [gguf.Q4_1, gguf.Q8_0])
@pytest.mark.parametrize("n,k", [(576, 576), (3072, 576), (576, 1536), (48, 64)])
def test_amx_matmuls_equal_the_avx2_8_bit_path(qtype, n, k):
    if not gguf.amx():
        pytest.skip("the AMX GGUF matmul needs AMX (this CPU has none, or no amx build or tile state): "
                    "test_without_amx_the_layout_is_refused_never_misread checks the refusal here")
    b = blocks(n, k, qtype, seed=n + k)
    packed, layout = gguf.amx_pack(b, qtype)
    avx2 = gguf.load("x86-64-v3")
    for m in (1, 3, 4, 5, 16, 17, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = gguf.gguf_matmul(x, packed, layout, n)
        want = torch.empty(m, n)
        assert avx2.kvp_gguf_matmul(qtype, b.data_ptr(), n, k, x.data_ptr(), k, m, want.data_ptr(), n, 2, 1) == 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_without_amx_the_layout_is_refused_never_misread():
    """Where the amx build cannot run (no AMX, no amx build, or no tile state granted), a matmul in
    the AMX layout fails (RuntimeError) rather than reading the tiles as another layout."""
    if gguf.amx():
        pytest.skip("checks the refusal on CPUs without AMX; this one has it (the matmul tests above run)")
    for qtype in (gguf.Q4_1, gguf.Q8_0):
        packed, layout = gguf.amx_pack(blocks(48, 64, qtype), qtype)
        with pytest.raises(RuntimeError, match="failed"):
            gguf.gguf_matmul(torch.randn(2, 64), packed, layout, 48)


def test_the_amx_layout_takes_8_bit_activations_only():
    packed, layout = gguf.amx_pack(blocks(16, 64, gguf.Q4_1), gguf.Q4_1)
    with pytest.raises(ValueError, match="8-bit activations only"):
        gguf.gguf_matmul(torch.randn(1, 64), packed, layout, 16, activations="float32")
