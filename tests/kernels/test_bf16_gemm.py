"""The small-M bfloat16 matmul (kernels/cpu/bf16_gemm.py): its packed layout, its product
against a float64 reference and oneDNN's (F.linear), on any CPU (the generic build runs the same
layout in plain C; the engine uses the kernel only where its kernel path says so), and the
linear layers' choice between it and oneDNN by row count."""

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.info import detect_cpu
from kvpilot.engine.cpu.row_limits import ROW_LIMITS, bf16_kernel_max_rows
from kvpilot.kernels.cpu import bf16_gemm
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.engine.layers.linear import RowParallelLinear, pack_weights_for_cpu

BF16 = torch.bfloat16


@pytest.fixture(params=["selected", "generic"])
def lib(request, monkeypatch):
    """This CPU's variant (the AVX512_BF16 kernel where the CPU has it) and the generic build (the
    same layout in plain C), with bf16_gemm.matmul routed to it."""
    variant = None if request.param == "selected" else "generic"
    lib = bf16_gemm.load(variant)
    cpu = detect_cpu()
    assert bf16_gemm.simd(variant) == (request.param == "selected" and selected_variant() in ("avx512_bf16", "amx"))
    assert cpu_kernel_path.choose(cpu).bf16_gemm == (bf16_gemm.simd() and bf16_kernel_max_rows(cpu) > 0)
    monkeypatch.setattr(bf16_gemm, "load", lambda variant=None: lib)
    return lib


def test_the_amx_build_serves_the_kernel_on_tiles_and_the_engine_takes_it_up_to_the_tiles_limit():
    # AMX CPUs load the amx build (kernels/cpu/loader.py); Linux 5.16+ grants it the tile state.
    # With k % 32 == 0 its matmuls run TDPBF16PS (the product tests above check them on such a CPU);
    # other shapes, and every other build, the vdpbf16ps loop or plain C.
    tiles = selected_variant() == "amx"
    assert bf16_gemm.amx() == tiles
    assert not bf16_gemm.amx("generic")
    if tiles:
        assert cpu_kernel_path.choose(detect_cpu()).bf16_gemm_max_rows == ROW_LIMITS.bf16_kernel_amx_tiles.rows == 256


def test_pack_puts_pairs_of_k_of_64_columns_in_vdpbf16ps_order():
    w = torch.arange(128 * 6, dtype=torch.float32).reshape(128, 6).to(BF16)
    packed = bf16_gemm.pack(w).view(2, 3, 4, 16, 2)  # [group][pair][vector][lane][element]
    for g, p, j, i, e in [(0, 0, 0, 0, 0), (1, 2, 3, 15, 1), (0, 1, 2, 7, 1), (1, 0, 1, 3, 0)]:
        assert packed[g, p, j, i, e] == w[64 * g + 16 * j + i, 2 * p + e]
    with pytest.raises(ValueError, match="N % 64"):
        bf16_gemm.pack(torch.zeros(100, 6, dtype=BF16))
    with pytest.raises(ValueError, match="K even"):
        bf16_gemm.pack(torch.zeros(64, 5, dtype=BF16))


@pytest.mark.parametrize("n,k", [(64, 2), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 17, 31, 32])  # every tail of the 6-row (and AMX 16-row) tiles
def test_product_matches_float64_and_onednn(lib, m, n, k, seed):
    torch.manual_seed(seed)
    w, x = torch.randn(n, k).to(BF16), torch.randn(m, k).to(BF16)
    got = bf16_gemm.matmul(x, bf16_gemm.pack(w), n)
    ref = x.double() @ w.double().T  # the bf16 products are exact; the sums lose only float32 bits
    assert got.dtype == BF16 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-6 * ref.abs().max().item())
    # oneDNN computes the same exact products in another order: a few values round one step apart
    want = F.linear(x, w)
    assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6 * ref.abs().max().item())


def test_rows_may_be_a_strided_view_and_bad_inputs_are_refused(lib, seed):
    torch.manual_seed(seed)
    w, big = torch.randn(128, 64).to(BF16), torch.randn(4, 200).to(BF16)
    x = big[:, 10:74]  # row stride 200
    torch.testing.assert_close(bf16_gemm.matmul(x, bf16_gemm.pack(w), 128).float(),
                               bf16_gemm.matmul(x.contiguous(), bf16_gemm.pack(w), 128).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        bf16_gemm.matmul(x.float(), bf16_gemm.pack(w), 128)
    with pytest.raises(ValueError, match="bad shapes/dtypes"):
        bf16_gemm.matmul(x, bf16_gemm.pack(w), 64)


def test_linear_layers_take_the_kernel_up_to_its_row_limit_and_onednn_above(lib, seed, monkeypatch):
    # where the kernel does not run (no AVX512_BF16, AMX, or no oneDNN bf16 to pack beside it) the
    # layer gets no kernel copy, keeps its plain weight and never calls the kernel
    used = cpu_kernel_path.current().bf16_gemm and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.manual_seed(seed)
    layer = RowParallelLinear(192, 128, BF16)
    layer.weight.data.copy_(torch.randn(128, 192).to(BF16))
    plain = layer.weight.detach().clone()
    pack_weights_for_cpu(layer)
    assert (layer.bf16_packed is not None) == used and (layer.weight.numel() == 0) == used
    calls = []
    kernel = bf16_gemm.matmul
    monkeypatch.setattr(bf16_gemm, "matmul", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    limit = cpu_kernel_path.current().bf16_gemm_max_rows or ROW_LIMITS.bf16_kernel.rows
    for m in (1, limit, limit + 1, 2 * limit + 2):
        x = torch.randn(m, 192).to(BF16)
        torch.testing.assert_close(layer(x).float(), F.linear(x, plain).float(), rtol=2**-7, atol=1e-2)
    assert calls == ([1, limit] if used else [])
