"""The row limits of the CPU decode path, in one table: up to how many rows (tokens of a step) a
matmul takes one of our kernels instead of oneDNN's, by CPU kind and activation format, each with
the measurement that set it. engine/cpu_kernel_path.choose reads them (`bf16_kernel_max_rows`,
`gguf_max_rows`) into the path; the layers keep the path's limits and the C decode stack serves as
many rows as its layers' matmuls take (engine/models/cpu_decode_stack.py).

A limit is a crossover: it moves with the CPU, the thread count and the kernels, so change one only
with a new measurement of the command cited beside it, on the CPU kind it names. The kernels
themselves take any row count (kernels/cpu/bf16_gemm.py, gguf.py); nothing but this table bounds
them. Standard library only: the table is data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.cpu.info import CpuInfo, has_bf16_matmul_kernel


@dataclass(frozen=True)
class RowLimit:
    """rows: the most rows of a matmul the kernel takes (above: oneDNN's matmul on the dense or
    packed weight); measured: the measurement that set it (command, CPU, numbers, commit)."""

    rows: int
    measured: str


@dataclass(frozen=True)
class RowLimits:
    """bf16_kernel: bfloat16 matmuls on kernels/cpu/bf16_gemm.py's kernel, AVX512_BF16 CPUs
    without AMX; bf16_kernel_amx_tiles: the same kernel where it runs on AMX tiles itself
    (bf16_gemm.amx()), which also bounds the C decode stack's rows there;
    bf16_kernel_vdpbf16ps_on_amx: the same kernel's vdpbf16ps loop on an AMX CPU whose tiles it
    cannot use (oneDNN's tiles take larger steps); gguf_q8: `--quantization gguf`'s blocks with
    8-bit activations on the AVX2 dot products; gguf_q8_amx: the same on AMX int8 tiles
    (kernels/cpu/gguf.amx()); gguf_float32: the blocks with float32 activations
    (KVPILOT_GGUF_ACTIVATIONS=float32, the tiled kernel)."""

    bf16_kernel: RowLimit
    bf16_kernel_amx_tiles: RowLimit
    bf16_kernel_vdpbf16ps_on_amx: RowLimit
    gguf_q8: RowLimit
    gguf_q8_amx: RowLimit
    gguf_float32: RowLimit


ROW_LIMITS = RowLimits(
    bf16_kernel=RowLimit(32, (
        "eee3b65, Zen 4 EPYC (AVX512_BF16, no AMX), 2 threads, a step's 120 layer matmuls in one process: "
        "the kernel 1.4-2x oneDNN's bf16 matmuls at 1-8 rows, 1.2-1.3x at 16, 1.15x at 32 (not measured above); "
        "offline bf16 decode steps of 9-23 sequences 44.2 -> 39.2 ms. On AMX tiles (Sapphire Rapids, "
        "`kvpilot bench decode-step --dtypes bfloat16 --cpu-kernel onednn,bf16-gemm --batch-sizes "
        "1,4,8,12,16,24,32 --threads 2 --steps 16 --rounds 3`, "
        "benchmarks/results/throughput/amx/decode_step_onednn_vs_amx_tiles_t2.json): 14.9 vs 32.6 ms a step "
        "at 1 row, 22.6 vs 40.2 at 16, 32.8 vs 53.7 at 32")),
    bf16_kernel_amx_tiles=RowLimit(256, (
        "issue 49, Sapphire Rapids VM, 2 threads, whole decode steps of the kernel + C decode stack against "
        "oneDNN layer by layer (the default above the limit), with the limit raised to 256 for the probe: "
        "`kvpilot bench decode-step --dtypes bfloat16 --cpu-kernel onednn,bf16-gemm --batch-sizes "
        "64,96,128,192,256 --prompt-len 256 --quantization none --threads 2`, ms a step: 60.5 vs 87.2 at 64, "
        "82.1 vs 110.0 at 96, 105.0 vs 131.1 at 128, 156.7 vs 180.2 at 192, 202.3 vs 232.5 at 256; the GGUF "
        "default (`--cpu-kernel on --quantization gguf --batch-sizes 96,128,256`), limit 256 vs 64: 89.2 vs 112.7, "
        "120.6 vs 132.3, 217.1 vs 246.3; a server on its defaults at 128 concurrent ShareGPT requests, 2 "
        "interleaved passes each: median ITL 144/150 ms vs 163/187, 545/527 vs 540/455 tok/s. A layer's matmuls "
        "alone with the weights in cache favour oneDNN above 64 rows (`python -P "
        "benchmarks/results/amx_rows/matmul_rows.py`: 0.60 vs 0.52 ms at 128, 1.09 vs 0.88 at 256), but a "
        "step reads 30 layers' weights from memory: cold, 30 layers' four matmuls took 25.6 vs 28.9 ms at 128 "
        "rows and 41.7 vs 41.3 at 256 (benchmarks/results/amx_rows/README.md)")),
    bf16_kernel_vdpbf16ps_on_amx=RowLimit(8, (
        "596a719, Sapphire Rapids VM, 2 threads, alone: `kvpilot bench decode-step --dtypes bfloat16 "
        "--cpu-kernel on,bf16-gemm --batch-sizes 1,4,8,12,16,24,32 --threads 2 --steps 16 --rounds 3` "
        "(benchmarks/results/throughput/amx/decode_step_vdpbf16ps_rows_t2.json), kernel + stack vs oneDNN's "
        "AMX matmuls, ms a step: 14.7 vs 25.7 at 1 row, 21.6 vs 26.7 at 4, 26.9 vs 29.0 at 8, 34.7 vs 33.2 "
        "at 12, 69.1 vs 49.8 at 32")),
    gguf_q8=RowLimit(8, (
        "vLLM's MMVQ_MAX_BATCH_SIZE (vllm/model_executor/layers/quantization/gguf.py), since ea2bbc6; no "
        "crossover of ours on CPUs without AMX (Zen 4 and AVX2-only EPYCs were not measured at it). On "
        "Sapphire Rapids, 46832e3, 2 threads: `kvpilot bench decode-step --dtypes bfloat16 --quantization "
        "none,gguf --batch-sizes 1,2,3,4,6 --threads 2 --steps 16 --rounds 3` "
        "(benchmarks/results/throughput/amx/decode_step_dense_vs_gguf_avx2_t2.json), dense bf16 vs the blocks "
        "on the AVX2 8-bit dot products, ms a step: 12.6 vs 6.1 at 1 row, 15.1 vs 14.6 at 4, 16.1 vs 19.1 at 6; "
        "AMX CPUs take gguf_q8_amx since")),
    gguf_q8_amx=RowLimit(16, (
        "b97763e, Sapphire Rapids VM, 2 threads: `kvpilot bench decode-step --dtypes bfloat16 "
        "--quantization none,gguf --batch-sizes 1,8,16,24,32 --threads 2 --steps 16 --rounds 3` "
        "(benchmarks/results/throughput/amx/decode_step_dense_vs_gguf_amx_t2.json), dense bf16 vs the blocks, "
        "ms a step: 13.1 vs 6.0 at 1 row, 16.7 vs 12.7 at 8, 20.5 vs 18.2 at 16, 26.5 vs 26.9 at 24, "
        "30.1 vs 31.7 at 32")),
    gguf_float32=RowLimit(64, (
        "b714a77, 2-core AVX2 EPYC, 2 threads, a step's 121 matmuls each on a distinct weight "
        "(`git show bbe6366:benchmarks/results/throughput/README.md`, section 12, tiled_matmuls_avx2.json), "
        "the tiled kernel vs oneDNN's packed float32, ms: 46.7 vs 66.0 at 16 rows, 79.6 vs 104.0 at 32, "
        "146.9 vs 186.8 at 64, 298.4 vs 296.1 at 128")),
)


def bf16_kernel_max_rows(cpu: CpuInfo, tiles: bool = False) -> int:
    """Up to how many rows a bfloat16 engine runs kernels/cpu/bf16_gemm.py's kernel on this CPU
    instead of oneDNN's matmul (0: never): AVX512F with AVX512_BF16 is needed; on an AMX CPU the
    kernel's `vdpbf16ps` loop hands over to oneDNN's tiles above
    ROW_LIMITS.bf16_kernel_vdpbf16ps_on_amx rows, unless the kernel runs on the tiles itself
    (`tiles`: bf16_gemm.amx(), then ROW_LIMITS.bf16_kernel_amx_tiles)."""
    if not has_bf16_matmul_kernel(cpu):
        return 0
    if "amx_bf16" in cpu.flags:
        return (ROW_LIMITS.bf16_kernel_amx_tiles if tiles else ROW_LIMITS.bf16_kernel_vdpbf16ps_on_amx).rows
    return ROW_LIMITS.bf16_kernel.rows


def gguf_max_rows(activations: str, amx_int8: bool = False) -> int:
    """Up to how many rows a matmul reads `--quantization gguf`'s blocks instead of the dense
    weight: with float32 activations ROW_LIMITS.gguf_float32; with 8-bit ones ("q8_1")
    ROW_LIMITS.gguf_q8_amx where they run on AMX tiles (`amx_int8`), else ROW_LIMITS.gguf_q8."""
    if activations == "float32":
        return ROW_LIMITS.gguf_float32.rows
    return (ROW_LIMITS.gguf_q8_amx if amx_int8 else ROW_LIMITS.gguf_q8).rows
