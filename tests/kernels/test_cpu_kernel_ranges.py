"""The C kernels' torch-profiler ranges (kvpilot.kernels.cpu.loader.kernel_range) and their groups in
`kvpilot bench throughput`'s step breakdown: ctypes calls are invisible to the torch profiler, so
without the ranges a step run by the C decode stack was reported as 98 % "python, scheduling and
other"."""

import pathlib
import re

import torch
from paged_cases import HEADS, make_paged_batch

from kvpilot.bench.throughput import PROFILE_GROUPS, profile_group
from kvpilot.kernels.cpu import loader as cpu_build
from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu import norm_act as cpu_ops


def test_without_a_profiler_the_range_is_a_shared_no_op():
    assert cpu_build.kernel_range("rms_norm") is cpu_build.kernel_range("decode_stack")


def test_a_recording_profiler_sees_the_c_kernels_with_their_time():
    if cpu_decode.load() is None:
        raise AssertionError("the CPU kernel library did not build here (a C compiler is part of `make install`)")
    batch = make_paged_batch([300, 40], [1, 1], *HEADS["gqa"], 64, 16, torch.float32)
    batch.write_new_tokens()
    x, w = torch.randn(64, 576), torch.randn(576)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        cpu_ops.rms_norm(x, w, 1e-5)
        cpu_decode.paged_decode_attention(batch.query, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(),
                                          batch.block_tables, batch.seq_lens, 0.125, torch.empty_like(batch.query))
    events = {e.key: e for e in prof.key_averages()}
    for name in ("kvpilot::rms_norm", "kvpilot::attention_decode"):
        assert name in events, sorted(events)
        assert events[name].self_cpu_time_total > 0


def test_every_kernel_range_falls_in_a_breakdown_group():
    # every range the engine and the CPU kernels open (kernel_range("...") anywhere under engine/ or
    # kernels/cpu/), so a new kernel cannot land in "python, scheduling and other" unnoticed
    root = pathlib.Path(cpu_decode.__file__).resolve().parents[2]
    names = {m for d in ("engine", "kernels/cpu") for f in (root / d).rglob("*.py")
             for m in re.findall(r'kernel_range\("(\w+)"\)', f.read_text())}
    assert {"decode_stack", "gguf_matmul", "bf16_matmul", "attention_decode", "rms_norm"} <= names
    groups = {n: profile_group(f"kvpilot::{n}") for n in names}
    assert None not in groups.values(), groups
    assert groups["decode_stack"].startswith("decode stack")
    assert groups["gguf_matmul"].startswith("matmul") and groups["bf16_matmul"].startswith("matmul")
    assert groups["attention_decode"] == groups["attention_prefill"] == "attention (SDPA, C kernels)"
    assert groups["rms_norm"] == groups["silu_mul"] == "elementwise (norm, RoPE, SiLU, residual)"
    assert groups["sample_rows"] == "sampling"
    assert set(groups.values()) <= set(PROFILE_GROUPS)
    assert profile_group("aten::mm") == "matmul (linear layers, LM head)"
    assert profile_group("kvpilot::something_new") is None  # counted as "other", not silently misfiled
