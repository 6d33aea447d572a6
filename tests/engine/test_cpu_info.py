"""`--dtype auto` on CPU follows the CPU's flags (bf16 only with native bf16), logs why,
and the engine's KV-cache space on CPU follows vLLM's VLLM_CPU_KVCACHE_SPACE."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.cpu.info import CpuInfo, choose_auto_dtype, choose_cpu_dtype, detect_cpu
from kvpilot.engine.memory import GiB, KVCachePlan, RankMemory, cpu_kvcache_space_bytes

EPYC_AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 adx"
SAPPHIRE_RAPIDS = EPYC_AVX2 + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
SKYLAKE_X = EPYC_AVX2 + " avx512f avx512bw avx512vl avx512dq"


def cpu(flags: str, name: str = "test CPU") -> CpuInfo:
    return CpuInfo.parse(f"processor\t: 0\nmodel name\t: {name}\nflags\t\t: {flags}\n\nprocessor\t: 1\n")


@pytest.mark.parametrize("flags, dtype", [
    (EPYC_AVX2, torch.float32),
    (SKYLAKE_X, torch.float32),  # AVX-512 but no BF16: still the slow bf16 path
    (SAPPHIRE_RAPIDS, torch.bfloat16),
    (EPYC_AVX2 + " avx512_bf16", torch.bfloat16),  # e.g. AMD Zen 4
    (EPYC_AVX2 + " amx_bf16", torch.bfloat16),
    ("", torch.float32),  # unreadable /proc/cpuinfo
])
def test_auto_dtype_on_cpu_follows_native_bf16_flags(flags, dtype):
    choice = choose_cpu_dtype(cpu(flags))
    assert choice.dtype == dtype
    assert "test CPU" in choice.reason
    if dtype == torch.float32:
        assert "no native bf16" in choice.reason
    else:
        assert "bf16" in choice.reason and ("avx512_bf16" in choice.reason or "amx_bf16" in choice.reason)


def test_cpuinfo_parsing_reads_the_first_model_name_and_the_isa_flags():
    info = cpu(SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+")
    assert info.model_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.native_bf16
    d = info.as_dict()
    assert "amx_bf16" in d["isa_flags"] and "avx2" in d["isa_flags"] and "bmi2" not in d["isa_flags"]
    assert d["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_cuda_auto_stays_bfloat16():
    assert choose_auto_dtype("cuda:0", cpu(EPYC_AVX2)).dtype == torch.bfloat16


def test_engine_args_resolve_auto_with_this_machines_rule_and_log_it(caplog):
    want = choose_cpu_dtype(detect_cpu())
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        config = EngineArgs(dtype="auto", device="cpu", max_model_len=256).create_engine_config()
    assert config.model.dtype == want.dtype
    assert any("dtype auto" in r.message and want.reason in r.message for r in caplog.records)
    explicit = EngineArgs(dtype="float32", device="cpu", max_model_len=256).create_engine_config()
    assert explicit.model.dtype == torch.float32


@pytest.mark.parametrize("value, gib", [(None, 4), ("", 4), ("0", 4), ("2", 2), ("0.25", 0.25), ("40", 40)])
def test_cpu_kvcache_space_follows_vllm_with_a_4_gib_default(value, gib):
    env = {} if value is None else {"VLLM_CPU_KVCACHE_SPACE": value}
    assert cpu_kvcache_space_bytes(env) == int(gib * GiB)


@pytest.mark.parametrize("value", ["-1", "lots", "nan"])
def test_bad_cpu_kvcache_space_is_refused_with_the_variable_named(value):
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        cpu_kvcache_space_bytes({"VLLM_CPU_KVCACHE_SPACE": value})


def test_the_space_caps_each_rank_and_the_memory_budget_still_bounds_it():
    ranks = [RankMemory(0, 300 << 20, 50 << 20, 1 << 20), RankMemory(1, 300 << 20, 50 << 20, 2 << 20)]
    # 24 GiB x 0.9 would leave ~20.9 GiB (about 7,100 blocks of 3 MiB over both ranks)
    roomy = KVCachePlan.build(24 * GiB, 0.9, 16, ranks, shared_memory=True, space_bytes=GiB)
    assert roomy.num_blocks == GiB // (2 << 20)  # rank 1's larger blocks fill its 1 GiB first
    assert "VLLM_CPU_KVCACHE_SPACE" in roomy.describe()
    tight = KVCachePlan.build(2 * GiB, 0.5, 16, ranks, shared_memory=True, space_bytes=4 * GiB)
    assert tight.num_blocks == (GiB - (600 << 20) - (100 << 20)) // (3 << 20)
    assert KVCachePlan.build(2 * GiB, 0.5, 16, ranks, True).num_blocks == tight.num_blocks
