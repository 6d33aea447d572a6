"""The GGUF block matmul for CPU (engine/layers/gguf_kernel.py) with float32 activations
against a float64 dequantize-then-matmul reference (gguf-py's block layouts), at
decode-sized M, in two variants: the one this CPU loads (AVX2 code above generic) and the generic scalar one."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from kvpilot.kernels.cpu import gguf as gguf_kernel
from kvpilot.kernels.cpu.gguf import Q4_1, Q8_0, gguf_matmul
from kvpilot.kernels.cpu.loader import selected_variant


@pytest.fixture(scope="module")
def kernel():
    if gguf_kernel.load() is None:
        pytest.fail("the GGUF matmul kernel did not build; `make test` installs a C compiler")
    return gguf_kernel


@pytest.fixture(scope="module", params=["selected", "generic"])
def build_lib(request, kernel):
    """Two variants of the library, as (name, lib): the one this CPU loads (AVX2 where the CPU
    has it) and the generic build (the scalar loops); tests route gguf_matmul to it."""
    if request.param == "selected":
        lib = kernel.load()
        assert lib.kvp_gguf_simd() == int(selected_variant() != "generic")
    else:
        lib = kernel.load("generic")
        assert lib.kvp_gguf_simd() == 0
    return request.param, lib


@pytest.fixture
def lib(build_lib, monkeypatch):
    monkeypatch.setattr(gguf_kernel, "load", lambda: build_lib[1])
    return build_lib[1]


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """Random GGUF blocks [n, k/32 * bytes] and their float64 dequantized weight [n, k]."""
    nb = k // 32
    d = (rng.random((n, nb, 1)) * 0.02 + 1e-3).astype(np.float16)
    if qtype == Q4_1:
        m = (-rng.random((n, nb, 1)) * 0.1).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], -1)
        q = np.concatenate([qs & 15, qs >> 4], -1)  # element j: low nibble of byte j, j+16: its high nibble
        weight = d.astype(np.float64) * q + m.astype(np.float64)
    else:
        qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8)
        raw = np.concatenate([d.view(np.uint8), qs.view(np.uint8)], -1)
        weight = d.astype(np.float64) * qs
    return torch.from_numpy(raw.reshape(n, -1).copy()), weight.reshape(n, k)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("m", [1, 3, 8, 11])
@pytest.mark.parametrize("n,k", [(37, 96), (577, 64), (64, 32)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_float64_dequant_matmul(lib, qtype, m, n, k, threads, seed, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    raw, weight = random_blocks(qtype, n, k, np.random.default_rng(seed))
    x = torch.randn(m, k + 5)[:, :k]  # strided rows, as a slice of a fused activation
    got = gguf_matmul(x, raw, qtype, n, activations="float32")
    want = x.double().numpy() @ weight.T
    # float32 accumulation over k terms: error grows with sqrt(k) times the magnitude of the terms
    tol = 1e-6 * np.sqrt(k) * (np.abs(x.double().numpy()) @ np.abs(weight).T).max()
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=tol)


@pytest.fixture
def tiled_from(kernel):
    """Sets the row count from which float32 calls take the tiled path; restores it after."""
    lib = kernel.load()
    old = lib.kvp_gguf_set_tiled_min_m(2)
    yield lib.kvp_gguf_set_tiled_min_m
    lib.kvp_gguf_set_tiled_min_m(old)


@pytest.mark.parametrize("path", ["row", "tiled"])
@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 16, 33])  # every tail of the 3-row register tiles
@pytest.mark.parametrize("n,k", [(37, 96), (6, 1536)])  # 37: every tail of the 4-row panels
def test_row_and_tiled_paths_match_float64_dequant_matmul(tiled_from, path, qtype, m, n, k, seed, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    tiled_from(1 if path == "tiled" else 1 << 30)
    raw, weight = random_blocks(qtype, n, k, np.random.default_rng(seed))
    x = torch.randn(m, k + 3)[:, :k]
    got = gguf_matmul(x, raw, qtype, n, activations="float32")
    want = x.double().numpy() @ weight.T
    tol = 1e-6 * np.sqrt(k) * (np.abs(x.double().numpy()) @ np.abs(weight).T).max()
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
def test_tiled_path_dequantizes_to_gguf_pys_float32_values_exactly(kernel, tiled_from, qtype, seed):
    # x = the identity: y = W^T with one non-zero product per output, so y holds the dequantized
    # panel itself. It must equal gguf-py's float32 dequantization (d * q + m; d * q is exact, the
    # + m rounds once), i.e. the dense float32 weights transformers loads from the same GGUF.
    k = 96
    raw, weight = random_blocks(qtype, 10, k, np.random.default_rng(seed))
    tiled_from(1)
    got = gguf_matmul(torch.eye(k), raw, qtype, 10, activations="float32")
    # the tiled path is the AVX2 build's (the scalar build's row loop gives the same exact values)
    assert kernel.load().kvp_gguf_simd() == int(selected_variant() != "generic")
    assert torch.equal(got.T, torch.from_numpy(weight).float())


def test_out_buffer_and_shape_checks(kernel, seed):
    raw, weight = random_blocks(Q8_0, 40, 64, np.random.default_rng(seed))
    x = torch.randn(2, 64)
    out = torch.full((2, 40), float("nan"))
    assert gguf_matmul(x, raw, Q8_0, 40, out=out) is out
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="bad shapes"):
        gguf_matmul(torch.randn(2, 48), raw, Q8_0, 40)  # k not a multiple of 32
    with pytest.raises(ValueError, match="bad shapes"):
        gguf_matmul(x, raw, Q4_1, 40)  # Q8_0 rows read as Q4_1
    with pytest.raises(ValueError, match="not supported"):
        gguf_matmul(x, raw, 2, 40)  # Q4_0
    with pytest.raises(ValueError, match="bad shapes"):
        gguf_matmul(x.double(), raw, Q8_0, 40)
    with pytest.raises(ValueError, match="activations must be one of"):
        gguf_matmul(x, raw, Q8_0, 40, activations="int4")
