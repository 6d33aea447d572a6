"""The GGUF kernel's 8-bit activation path (engine/layers/gguf_q8_c.py) in both builds
(native AVX2 and portable scalar): the activation quantizer against a numpy reference of
ggml's quantize_row_q8_1 (d, q, s), and the matmul against a float64 reference that
quantizes x the same way. The block sums are integers, so the only error left is float
rounding of the per-block scaling and accumulation: the tolerance is tight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_matmul import build_lib, kernel, lib, random_blocks  # noqa: F401 (fixtures)

from kvpilot.kernels.cpu import gguf as gguf_kernel
from kvpilot.kernels.cpu.gguf import Q4_1, Q8_0, gguf_matmul, quantize_q8_1


def reference_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K] int8, d, s [M, K/32] float32) as ggml's quantize_row_q8_1,
    in float32 arithmetic, rounding ties to even (ggml's AVX2 quantizer; its scalar
    reference rounds them away from zero)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    s = d * q.astype(np.int32).sum(-1).astype(np.float32)
    return q.reshape(m, k), d, s


def decode_blocks(raw: torch.Tensor, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [N, K/32 * bytes] -> (d, m [N, K/32] float64, q [N, K/32, 32] int64); m = 0 for Q8_0."""
    n = raw.shape[0]
    b = raw.numpy().reshape(n, -1, 20 if qtype == Q4_1 else 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    if qtype == Q4_1:
        mins = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        q = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], -1).astype(np.int64)
    else:
        mins, q = np.zeros_like(d), b[..., 2:].view(np.int8).astype(np.int64)
    return d, mins, q


def test_quantizer_matches_ggml_q8_1(lib, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 224 + 7)) * rng.choice([1e-3, 1.0, 50.0], (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0, s = 0
    # max 127 -> d = 1 exactly: 2.5 and -3.5 are ties, rounded to even (2, -4)
    x[2, :32] = np.linspace(-20, 20, 32, dtype=np.float32)
    x[2, :4] = [127.0, 2.5, -3.5, 0.5]
    xt = torch.from_numpy(x)[:, :224]  # strided rows
    q, d, s = quantize_q8_1(xt)
    want_q, want_d, want_s = reference_q8_1(x[:, :224].copy())
    np.testing.assert_array_equal(q.numpy(), want_q)
    np.testing.assert_array_equal(d.numpy(), want_d)
    np.testing.assert_array_equal(s.numpy(), want_s)
    assert q[2, :4].tolist() == [127, 2, -4, 0] and d[1, 1] == 0 and (q[1, 32:64] == 0).all()


@pytest.mark.parametrize("qtype", [Q4_1, Q8_0])
@pytest.mark.parametrize("m", [1, 2, 3, 6, 8])
@pytest.mark.parametrize("n,k", [(37, 96), (577, 224), (6, 800)])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_matmul_matches_the_quantized_reference(lib, qtype, m, n, k, threads, seed, monkeypatch):
    # k = 3, 7, 25 blocks (no multiple of 8); n = 37 and 6 leave tile remainders; m = 1, 2, 3, 6
    # and 8 reach every tile shape (4x1, 4x2, 2x3, 2x4 and the 1-row tails)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rng = np.random.default_rng(seed)
    raw, _ = random_blocks(qtype, n, k, rng)
    x = torch.randn(m, k + 5)[:, :k]
    got = gguf_matmul(x, raw, qtype, n).numpy()
    xq, xd, xs = reference_q8_1(x.numpy().copy())
    wd, wm, wq = decode_blocks(raw, qtype)
    isum = np.einsum("nbj,ibj->inb", wq, xq.reshape(m, -1, 32).astype(np.int64))  # exact integers
    dd = wd[None] * xd.astype(np.float64)[:, None]  # [m, n, blocks]
    ms = wm[None] * xs.astype(np.float64)[:, None]
    want = (dd * isum + ms).sum(-1)
    scale = (np.abs(dd * isum) + np.abs(ms)).sum(-1)
    np.testing.assert_array_less(np.abs(got - want), 1e-5 * scale + 1e-30)


def test_q8_path_is_close_to_the_float32_path(kernel, seed):
    # 8-bit activations lose at most half a step of d = max|x|/127 per element: the result
    # stays within that bound of the exact (float32-activation) matmul
    rng = np.random.default_rng(seed)
    raw, weight = random_blocks(Q4_1, 64, 576, rng)
    x = torch.randn(4, 576)
    exact = x.double().numpy() @ weight.T
    got = gguf_matmul(x, raw, Q4_1, 64).numpy()
    _, d, _ = reference_q8_1(x.numpy())
    bound = (np.abs(weight).reshape(64, -1, 32).sum(-1)[None] * d[:, None] / 2).sum(-1)  # [m, n]
    assert (np.abs(got - exact) <= bound * 1.001).all()
    assert np.abs(got - exact).max() > 0  # the path really quantizes x
