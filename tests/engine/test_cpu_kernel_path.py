"""The CPU decode path as one value (engine/cpu/kernel_path.py): `choose` reads the three
environment switches and nothing else does, overrides make every comparison's mode a path, a path
that contradicts itself is refused, `apply` sets a model's modules from it; the row limits come
from one table (engine/cpu/row_limits.py), each with the measurement that set it."""

from __future__ import annotations

import re

import pytest
import torch

from kvpilot.engine.cpu import kernel_path as cpu_kernel_path
from kvpilot.engine.cpu.info import CpuInfo, has_bf16_matmul_kernel
from kvpilot.engine.cpu.row_limits import ROW_LIMITS, RowLimits, bf16_kernel_max_rows, gguf_max_rows
from kvpilot.engine.layers.activation import SiluAndMul
from kvpilot.engine.layers.layernorm import RMSNorm
from kvpilot.engine.models.cpu_decode_stack import set_module_kernels

OFF = {cpu_kernel_path.KERNELS_ENV: "0"}
EPYC_AVX2 = "fpu sse sse2 avx f16c fma avx2"
SAPPHIRE_RAPIDS = EPYC_AVX2 + " avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"


def cpu(flags: str) -> CpuInfo:
    return CpuInfo.parse(f"processor\t: 0\nmodel name\t: test CPU\nflags\t\t: {flags}\n")


def test_the_gguf_activation_switch_is_part_of_the_path_and_a_bad_value_is_refused():
    assert cpu_kernel_path.choose(env={}).gguf_activations == "q8_1"
    exact = cpu_kernel_path.choose(env={cpu_kernel_path.GGUF_ACTIVATIONS_ENV: "float32"})
    assert exact.gguf_activations == "float32" and not exact.gguf_amx
    assert exact.gguf_max_rows == ROW_LIMITS.gguf_float32.rows
    for env in ({cpu_kernel_path.GGUF_ACTIVATIONS_ENV: "fp16"}, {**OFF, cpu_kernel_path.GGUF_ACTIVATIONS_ENV: "fp16"}):
        with pytest.raises(ValueError, match="KVPILOT_GGUF_ACTIVATIONS='fp16': use one of q8_1, float32"):
            cpu_kernel_path.choose(env=env)


def test_the_kernels_off_switch_turns_every_c_kernel_off():
    path = cpu_kernel_path.choose(env=OFF)
    assert not (path.kernels or path.c_attention or path.fused_rope_cache or path.c_norm_act or path.decode_stack)
    assert path.bf16_gemm_max_rows == 0 and path.reason == "KVPILOT_CPU_KERNELS=0: the torch path, no C kernel"
    assert not cpu_kernel_path.choose(env={cpu_kernel_path.DECODE_STACK_ENV: "0"}).decode_stack


def test_overrides_make_a_mode_a_path_and_the_reason_names_them():
    default = cpu_kernel_path.choose(env={})
    path = cpu_kernel_path.choose(env={}, decode_stack=False, bf16_gemm_max_rows=3)
    assert not path.decode_stack and path.bf16_gemm_max_rows == 3 and path.c_norm_act
    assert path.reason == f"{default.reason}; set for a comparison: decode_stack=False, bf16_gemm_max_rows=3"
    # a format override brings its own row limit (and no AMX layout, which is 8-bit only)
    exact = cpu_kernel_path.choose(env={}, gguf_activations="float32")
    assert exact.gguf_max_rows == ROW_LIMITS.gguf_float32.rows and not exact.gguf_amx
    with pytest.raises(TypeError):
        cpu_kernel_path.choose(env={}, fuse_rope=False)


@pytest.mark.parametrize("overrides, what", [
    ({"c_norm_act": False}, "the decode stack calls the fused C attention, norm and activation"),
    ({"c_attention": False, "decode_stack": False}, "fused_rope_cache fuses RoPE into the C attention"),
    ({"gguf_activations": "float32", "gguf_amx": True}, "gguf_amx runs 8-bit activations only"),
    ({"gguf_activations": "int4"}, "gguf_activations='int4': use one of q8_1, float32"),
    ({"bf16_gemm_max_rows": -1}, "count rows"),
])
def test_a_path_that_contradicts_itself_is_refused(overrides, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        cpu_kernel_path.choose(env={}, **overrides)
    with pytest.raises(ValueError, match="kernels=False runs no C kernel: set c_attention off too"):
        cpu_kernel_path.choose(env=OFF, c_attention=True)


def test_applying_a_path_sets_the_norm_activation_and_attention_switches():
    class Layer(torch.nn.Module):  # holds an attention backend, as an attention layer does
        def __init__(self):
            super().__init__()
            from kvpilot.engine.attention.torch_backend import TorchAttentionBackend

            self.backend = TorchAttentionBackend()
            self.norm, self.act = RMSNorm(8, 1e-5, torch.float32), SiluAndMul()

    layer = Layer()
    set_module_kernels(layer, cpu_kernel_path.choose(env={}, fused_rope_cache=False, c_norm_act=False,
                                                     decode_stack=False))
    assert layer.backend.use_cpu_kernel and not layer.backend.fuse_rope_cache
    assert not (layer.norm.use_c_kernel or layer.act.use_c_kernel)
    set_module_kernels(layer, cpu_kernel_path.choose(env={}))
    assert layer.backend.use_cpu_kernel and layer.backend.fuse_rope_cache and layer.norm.use_c_kernel
    set_module_kernels(layer, cpu_kernel_path.choose(env=OFF))
    assert not (layer.backend.use_cpu_kernel or layer.norm.use_c_kernel or layer.act.use_c_kernel)


@pytest.mark.parametrize("flags, rows, tile_rows", [
    (EPYC_AVX2 + " avx512f avx512bw avx512vl avx512_bf16", ROW_LIMITS.bf16_kernel.rows,
     ROW_LIMITS.bf16_kernel.rows),  # Zen 4: no tiles, one limit
    (SAPPHIRE_RAPIDS, ROW_LIMITS.bf16_kernel_vdpbf16ps_on_amx.rows,  # AMX: oneDNN's tiles above
     ROW_LIMITS.bf16_kernel_amx_tiles.rows),  # unless the kernel runs on the tiles itself
    (EPYC_AVX2 + " avx512f avx512bw avx512vl avx512dq", 0, 0),  # Skylake-X: AVX-512 without BF16
    (EPYC_AVX2, 0, 0),
])
def test_the_bf16_matmul_kernel_serves_avx512_bf16_cpus_up_to_a_row_limit_per_kind(flags, rows, tile_rows):
    assert bf16_kernel_max_rows(cpu(flags)) == rows
    assert has_bf16_matmul_kernel(cpu(flags)) == (rows > 0)
    # with the kernel on AMX tiles (bf16_gemm.amx()) an AMX CPU takes the tiles' own limit
    assert bf16_kernel_max_rows(cpu(flags), tiles=True) == tile_rows


def test_the_gguf_row_limit_follows_the_activation_format_and_the_amx_tiles():
    assert gguf_max_rows("q8_1") == ROW_LIMITS.gguf_q8.rows == 8  # vLLM's MMVQ_MAX_BATCH_SIZE
    assert gguf_max_rows("q8_1", amx_int8=True) == ROW_LIMITS.gguf_q8_amx.rows
    assert gguf_max_rows("float32") == gguf_max_rows("float32", amx_int8=True) == ROW_LIMITS.gguf_float32.rows


def test_every_row_limit_names_the_measurement_that_set_it():
    for name in RowLimits.__dataclass_fields__:
        limit = getattr(ROW_LIMITS, name)
        assert limit.rows > 0, name
        # a commit or a command, the CPU it ran on, and the figures (ms a step, or vLLM's own limit)
        assert re.search(r"\b[0-9a-f]{7}\b|kvpilot bench", limit.measured), name
        assert re.search(r"Zen 4|Sapphire Rapids|AVX2", limit.measured), name
        assert re.search(r"\d+(\.\d+)? (vs|ms)|vLLM", limit.measured), name
