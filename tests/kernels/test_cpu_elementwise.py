"""The C RMSNorm (vLLM's fused_add_rms_norm) and SiLU-and-mul (csrc/layernorm.c, activation.c),
each build against a float64 reference rounded where the semantics round (bf16: silu(gate)
before the product with up, the normalized value before the weight, every stored value), on
awkward shapes (widths 576, 1536, 17, 1; rows 1, 3, 64, 2049, the last shared out over the
OpenMP team) and extreme inputs; and this CPU's AVX-512 loops (kvp_elementwise_simd) against the
portable ones of the generic build: the stored residual bit for bit (one rounding of the same
float sum), the bf16 rounding bit for bit with torch's over every bf16 value, NaN kept quiet;
SiLU within its exp's last bits (a tight bound), RMSNorm within its summation order's."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import loader

BF16, F32 = torch.bfloat16, torch.float32
ULP = 2.0**-23  # float32's relative step at 1
_P, _I = ctypes.c_void_p, ctypes.c_int64


class Ops:
    """kvp_rms_norm / kvp_silu_mul of one build (variant) for one dtype."""

    def __init__(self, dtype: torch.dtype, variant: str):
        lib = loader.load(cpu_decode.LIBRARY[dtype], variant)
        self.dtype, self.variant, self.simd = dtype, variant, bool(lib.kvp_elementwise_simd())
        self._norm = getattr(lib, cpu_decode.kernel_name("kvp_rms_norm", dtype))
        self._norm.restype, self._norm.argtypes = None, [_P, _P, _P, _P, _I, _I, ctypes.c_float]
        self._silu = getattr(lib, cpu_decode.kernel_name("kvp_silu_mul", dtype))
        self._silu.restype, self._silu.argtypes = None, [_P, _P, _I, _I]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, two = gate_up.shape
        out = torch.full((rows, two // 2), float("nan"), dtype=self.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, two // 2)
        return out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, eps: float = 1e-5):
        """(out, residual after) on copies; the inputs are left alone."""
        x, res = x.clone(), None if residual is None else residual.clone()
        out = x if res is not None else torch.full_like(x, float("nan"))
        self._norm(x.data_ptr(), None if res is None else res.data_ptr(), w.data_ptr(), out.data_ptr(),
                   x.shape[0], x.shape[1], eps)
        return out, res


@pytest.fixture(scope="module", params=[F32, BF16], ids=["f32", "bf16"])
def builds(request):
    """(this CPU's build, the portable generic build) for the dtype."""
    try:
        best = Ops(request.param, loader.selected_variant())
    except loader.KernelsNotBuilt as e:
        pytest.fail(f"the CPU kernels are not built: {e}")
    return best, Ops(request.param, "generic")


@pytest.fixture(scope="module")
def bf16_builds():
    """builds, for bfloat16 only (float32 stores without rounding)."""
    return Ops(BF16, loader.selected_variant()), Ops(BF16, "generic")


def _simd(best: Ops) -> Ops:
    if not best.simd:
        pytest.skip(f"this CPU's build ({best.variant}) has no AVX-512 element-wise loops")
    return best


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == BF16 else torch.int32)


def _silu64(g: torch.Tensor) -> torch.Tensor:
    return g / (1 + torch.exp(-g))  # float64: exp(1e30) = inf gives -0 at g = -1e30


def _silu_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """float64 silu(gate) * up, silu rounded to bf16 first for bf16 input; not rounded at the end."""
    g, u = gate_up.double().chunk(2, dim=-1)
    s = _silu64(g)
    if gate_up.dtype == BF16:
        s = s.float().bfloat16().double()
    return s * u


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws from the same seed, whatever ran before it (the bf16 bounds count values)."""
    torch.manual_seed(0)


def _gates(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 2 * width] gate | up: normal values times 4, some gates extreme."""
    gate_up = torch.randn(rows, 2 * width) * 4
    extremes = torch.tensor([100.0, -100.0, 88.0, -88.0, 89.0, -89.0, 1e30, -1e30, 0.0, -0.0, 17.0, -17.0])
    pick = torch.rand(rows, width) < 0.05
    gate_up[:, :width][pick] = extremes[torch.randint(len(extremes), (int(pick.sum()),))]
    return gate_up.to(dtype)


def _assert_f32_close(got: torch.Tensor, ref: torch.Tensor, ulps: float, atol: float) -> None:
    err = (got.double() - ref).abs()
    bound = ulps * ULP * ref.abs() + atol
    worst = int((err - bound).argmax())
    g, r = got.flatten()[worst].item(), ref.flatten()[worst].item()
    assert bool((err <= bound).all()), f"{g!r} vs {r!r}: {abs(g - r) / (ULP * abs(r) + 1e-300):.2f} ulp"


def _assert_bf16_nearly(got: torch.Tensor, want: torch.Tensor, max_fraction: float) -> None:
    """bf16 equal but for a few values (at most max_fraction of them, or 8) whose rounded
    intermediate sat one bf16 step away: at most 2**-7 relative, plus each side's final rounding."""
    assert got.dtype == want.dtype == BF16
    differ = int((_bits(got) != _bits(want)).sum())
    assert differ <= max(8, max_fraction * got.numel()), f"{differ} of {got.numel()} differ"
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=0)


@pytest.mark.parametrize("rows", [1, 3, 64, 2049])
@pytest.mark.parametrize("width", [1536, 576, 17, 1])
def test_silu_and_mul_against_float64(builds, rows, width, seed):
    gate_up = _gates(rows, width, builds[0].dtype)
    ref = _silu_ref(gate_up)
    for ops in builds:
        got = ops.silu_mul(gate_up)
        assert not got.isnan().any()
        if ops.dtype == F32:
            # the Cephes exp + refined reciprocal: <= 3.1 ulp measured for silu, then the product;
            # the portable loop (libmvec's expf, -ffast-math's reciprocal): <= 5.5 ulp. Results
            # below float32's normal range (gate < -87: e^-|g| is denormal) hold fewer bits.
            _assert_f32_close(got, ref, 4.0 if ops.simd else 7.0, atol=1e-40)
        else:
            # measured over 3M values: the AVX-512 loop's rounded silu is the float64 one's every
            # time, the portable loop's a step away for 0.09 % (its last bits are 5 ulp off)
            _assert_bf16_nearly(got, ref.float().bfloat16(), 1e-4 if ops.simd else 2e-3)
        # silu(-0) = -0, silu(-1e30) = -0 (not +0, not NaN); silu(100) = 100 to the bit in the
        # AVX-512 loop (the portable one's -ffast-math reciprocal of 1 is 1 - 2^-24)
        g = gate_up[:, :width]
        for value, want in ((-0.0, -0.0), (-1e30, -0.0), *(((100.0, 100.0),) if ops.simd else ())):
            at = g == value if value != -0.0 else (g == 0) & g.signbit()
            u = gate_up[:, width:][at]
            assert torch.equal(_bits(got[at]), _bits((u.double() * want).to(ops.dtype))), value


def test_silu_and_mul_simd_against_portable(builds, seed):
    simd, portable = _simd(builds[0]), builds[1]
    gate_up = _gates(2049, 1536, simd.dtype)
    got, want = simd.silu_mul(gate_up), portable.silu_mul(gate_up)
    if simd.dtype == F32:
        # each within a few ulp of silu * up (above), so within their sum of each other
        _assert_f32_close(got, want.double(), 10.0, atol=1e-40)
    else:
        _assert_bf16_nearly(got, want, 2e-3)


def test_silu_and_mul_rounds_products_and_nans_as_bf16_st(bf16_builds):
    """silu(100) = 100 exactly, so out = bf16(100 * up): every bf16 value of up, ties, denormals,
    infinities and NaNs included, rounded as torch rounds (round to nearest even); a NaN keeps
    its payload, quiet (bf16_st; torch would write 0x7fc0)."""
    builds = bf16_builds
    up = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16).reshape(64, 1024)
    gate_up = torch.cat((torch.full_like(up, 100.0), up), dim=1)
    want = (up.float() * 100).bfloat16()
    nan = up.isnan()
    want_bits = torch.where(nan, _bits(up) | 0x40, _bits(want))
    for ops in builds:
        got = ops.silu_mul(gate_up)
        assert torch.equal(_bits(got), want_bits), ops.variant
    # every bf16 gate: NaN out where the gate is NaN, or -inf (-inf / (1 + e^inf), as torch's
    # silu), always quiet; silu(inf) = inf
    gate_up = torch.cat((up, torch.ones_like(up)), dim=1)
    for ops in builds:
        got = ops.silu_mul(gate_up)
        assert torch.equal(got.isnan(), nan | (up == float("-inf")))
        assert bool((got[up == float("inf")] == float("inf")).all())
        assert bool(((_bits(got[nan]) & 0x40) != 0).all())


def _norm_ref(res: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 rms_norm(res) * w, the normalized value rounded to bf16 first for bf16; not rounded at the end."""
    r = res.double()
    n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if res.dtype == BF16:
        n = n.float().bfloat16().double()
    return n * w.double()


@pytest.mark.parametrize("rows", [1, 3, 64, 2049])
@pytest.mark.parametrize("hidden", [576, 1536, 17, 1])
@pytest.mark.parametrize("fused", [True, False], ids=["residual", "plain"])
def test_rms_norm_against_float64(builds, rows, hidden, fused, seed):
    dtype = builds[0].dtype
    x, res = (torch.randn(rows, hidden) * 3).to(dtype), torch.randn(rows, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    x[0, 0] = -0.0
    new_res = (res.float() + x.float()).to(dtype) if fused else x  # one rounding of the float sum
    ref = _norm_ref(new_res, w, 1e-5)
    for ops in builds:
        out, got_res = ops.rms_norm(x, w, res if fused else None)
        if fused:
            assert torch.equal(_bits(got_res), _bits(new_res)), ops.variant
        if dtype == F32:
            # the sum of squares in float32 (another order per build), inv_rms, two products
            _assert_f32_close(out, ref, 16.0, atol=0)
        else:
            _assert_bf16_nearly(out, ref.float().bfloat16(), 4e-4)


def test_rms_norm_simd_against_portable_extremes(builds, seed):
    simd, portable = _simd(builds[0]), builds[1]
    dtype = simd.dtype
    rows, hidden = 2049, 576
    x, res = (torch.randn(rows, hidden) * 3).to(dtype), torch.randn(rows, hidden).to(dtype)
    w = torch.randn(hidden).to(dtype)
    x[1], res[1] = 0.0, 0.0                       # a zero row: out 0 (inv_rms = 1 / sqrt(eps))
    x[2], res[2] = -0.0, -0.0                     # -0 + -0 = -0, out -0 * w
    x[3] *= 1e15                                  # large values, squares near float32's top
    x[4] = x[4].abs() * -1e-3                     # small negative sums
    x[5] = torch.tensor(1e-39).to(dtype)          # denormal residual sums (bf16: 0x000b)
    res[5] = 0.0
    x[6, ::7] = float("nan")                      # NaN in x only: the sum carries x's payload, quiet
    x[7, ::5] = float("inf")
    spread = torch.arange(-(2**15), 2**15, 113, dtype=torch.int32)[:hidden]  # bf16 bit patterns across the range
    x[8] = spread.to(torch.int16).view(BF16).to(dtype)
    out, got_res = simd.rms_norm(x, w, res)
    want_out, want_res = portable.rms_norm(x, w, res)
    assert torch.equal(_bits(got_res), _bits(want_res))  # the stored residual, bit for bit
    assert torch.equal(out.isnan(), want_out.isnan())
    ok = ~want_out.isnan()
    if dtype == F32:
        _assert_f32_close(out[ok], want_out[ok].double(), 4.0, atol=0)
    else:
        _assert_bf16_nearly(torch.where(ok, out, 0), torch.where(ok, want_out, 0), 2e-4)
    for row in (1, 2):
        assert torch.equal(_bits(out[row]), _bits(want_out[row]))
    # without the residual
    out, _ = simd.rms_norm(x, w, None)
    want_out, _ = portable.rms_norm(x, w, None)
    assert torch.equal(out.isnan(), want_out.isnan())


def test_residual_rounding_is_bf16_st_over_every_bf16_value(bf16_builds):
    """res + x rounded once for every bf16 x and a few res (ties at every exponent, denormals,
    infinities; NaN kept, quiet): torch's rounding of the same float sum, NaN aside."""
    builds = bf16_builds
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16).reshape(64, 1024)
    w = torch.ones(1024, dtype=BF16)
    for r in (0.0, 1.0, -3.5, 2.0**-133, 1.00390625, 65280.0):
        res = torch.full_like(x, r)
        want = (res.float() + x.float()).bfloat16()
        want_bits = torch.where(x.isnan(), _bits(x) | 0x40, _bits(want))
        for ops in builds:
            _, got = ops.rms_norm(x, w, res)
            assert torch.equal(_bits(got), want_bits), (ops.variant, r)
