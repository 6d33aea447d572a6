"""`kvpilot bench decode-step`: the time of one engine decode step by batch size, for
several dtypes side by side in one process, interleaved (dtype A, dtype B, A, B, ...) so a
shared machine's load falls on both alike.

Each engine holds `batch` requests of real ShareGPT prompts (cut to --prompt-len tokens)
past their prefill; a step is `LLMEngine.step()` (schedule, inputs, forward, sampling,
detokenization), timed in wall seconds and in this process's CPU seconds (which a loaded
machine inflates less than wall time). Also reports the CPU (model, ISA flags), the load
average before and after, and `--dtype auto`'s choice on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvpilot.bench.report import write_result
from kvpilot.engine.cpu.row_limits import ROW_LIMITS
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.machine import loadavg, machine_info


def _engine(model: str, dtype: str, max_batch: int, prompt_len: int, steps: int, quantization: str | None = None):
    from kvpilot.engine import LLM

    blocks_per_seq = -(-(prompt_len + steps * 64 + 64) // 16)
    return LLM(model, dtype=dtype, max_num_seqs=max_batch, max_model_len=2048, quantization=quantization,
               num_gpu_blocks_override=max(max_batch * blocks_per_seq, 2048 // 16) + 8, swap_space=0)


_QUANT_LABEL = {"default": "", "none": "/dense", "gguf": "/gguf"}
_MODE_LABEL = {"on": "", "unfused": "/unfused", "off": "/torch-attn", "bf16-gemm": "/bf16-gemm", "onednn": "/onednn"}
# --cpu-kernel modes as the kernel path fields each sets over the CPU's own choice (cpu_kernel_path.choose):
# 'on' all of the CPU's kernels; 'unfused' the C decode attention only (RoPE, the cache write, norms and
# SiLU in torch, so no decode stack); 'off' no C attention, norm or activation (the matmul kernels stay);
# 'bf16-gemm' the bf16 matmul kernel (and so the bf16 decode stack) up to its row limit whatever the CPU's
# default (where the engine keeps oneDNN's matmuls for some of those row counts, the two are compared in
# one process); 'onednn' every bf16 matmul on oneDNN (no bf16 kernel, so no bf16 decode stack): the
# default before the kernel served AMX CPUs
_MODES = {
    "on": {},
    "unfused": {"fused_rope_cache": False, "c_norm_act": False, "decode_stack": False},
    "off": {"c_attention": False, "fused_rope_cache": False, "c_norm_act": False, "decode_stack": False},
    "bf16-gemm": {"bf16_gemm_max_rows": None},  # the kernel's own limit here: _mode_overrides
    "onednn": {"bf16_gemm_max_rows": 0},
}


def _mode_overrides(mode: str) -> dict:
    """The kernel path fields `mode` sets; 'bf16-gemm' takes the kernel's own row limit on this CPU
    (ROW_LIMITS.bf16_kernel_amx_tiles where it runs on AMX tiles, else ROW_LIMITS.bf16_kernel)."""
    from kvpilot.kernels.cpu import bf16_gemm

    fields = dict(_MODES[mode])
    if fields.get("bf16_gemm_max_rows", 0) is None:
        tiles = bf16_gemm.amx()
        fields["bf16_gemm_max_rows"] = (ROW_LIMITS.bf16_kernel_amx_tiles if tiles else ROW_LIMITS.bf16_kernel).rows
    return fields


def _engine_in_mode(model: str, dtype: str, mode: str, max_batch: int, prompt_len: int, steps: int,
                    quantization: str | None = None):
    """An engine loaded with the kernel path of `mode` (see _MODES and --cpu-kernel)."""
    from kvpilot.engine.cpu import kernel_path as cpu_kernel_path

    with cpu_kernel_path.chosen(cpu_kernel_path.choose(**_mode_overrides(mode))):
        return _engine(model, dtype, max_batch, prompt_len, steps, quantization)


def _fill(llm, prompts: list[list[int]], tag: str) -> None:
    """Adds the requests and steps until every one of them is decoding."""
    from kvpilot.engine import SamplingParams

    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()


def _drain(llm, n: int, tag: str) -> None:
    for i in range(n):
        llm.engine.abort_request(f"{tag}-{i}")


def _time_steps(llm, steps: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of `steps` decode steps."""
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        llm.engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)


def _sharegpt_prompts(tok, count: int, prompt_len: int) -> list[list[int]]:
    """The first `count` ShareGPT prompts of at least prompt_len tokens, cut to prompt_len."""
    from kvpilot.loadgen.datasets import sharegpt_pairs

    prompts = []
    for prompt, _ in sharegpt_pairs():
        ids = tok.encode(prompt, add_special_tokens=False)
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
        if len(prompts) == count:
            break
    return prompts


def _time_batch(engines: dict, prompts: list[list[int]], batch: int, steps: int, rounds: int) -> dict[str, dict]:
    """Fills every engine with the first `batch` prompts, times `rounds` interleaved rounds of
    `steps` decode steps, drains them; per engine label: medians in ms, tok/s, each round's wall ms."""
    samples: dict[str, tuple[list[float], list[float]]] = {d: ([], []) for d in engines}
    for d, llm in engines.items():
        _fill(llm, prompts[:batch], f"b{batch}")
        _time_steps(llm, 2)  # warm-up at this batch size
    for _ in range(rounds):
        for d, llm in engines.items():
            wall, cpu = _time_steps(llm, steps)
            samples[d][0].append(wall)
            samples[d][1].append(cpu)
    rows = {}
    for d, llm in engines.items():
        _drain(llm, batch, f"b{batch}")
        wall, cpu = statistics.median(samples[d][0]), statistics.median(samples[d][1])
        rows[d] = {"step_wall_ms": wall, "step_cpu_ms": cpu,
                   "decode_tok_s": batch / wall * 1e3, "rounds_wall_ms": samples[d][0]}
        print(f"batch {batch:>3} {d:>9}: {wall:7.1f} ms/step wall, {cpu:7.1f} ms CPU, "
              f"{batch / wall * 1e3:7.1f} tok/s", flush=True)
    return rows


def _engines(args: argparse.Namespace, dtypes: list[str], modes: list[str], quants: list[str], max_batch: int) -> dict:
    """One engine per dtype x --cpu-kernel mode x --quantization value, by label."""
    engines = {}
    for d in dtypes:
        for mode in modes:
            for q in quants:
                engines[d + _MODE_LABEL[mode] + _QUANT_LABEL[q]] = _engine_in_mode(
                    args.model, d, mode, max_batch, args.prompt_len, args.steps * args.rounds,
                    None if q == "default" else q)
    return engines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench decode-step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, compared side by side")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per batch size")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--cpu-kernel", default="on",
                   help="the C kernels (float32 CPU), comma-separated modes run side by side: 'on' (all), "
                        "'unfused' (C decode attention only, labelled '<dtype>/unfused'), 'off' (torch only, "
                        "'<dtype>/torch-attn'), 'bf16-gemm' (bf16: decode matmuls on the AVX512_BF16 kernel "
                        "and the decode stack up to the kernel's row limit (32 rows, 256 on AMX tiles) even where the default keeps oneDNN, '<dtype>/bf16-gemm'), "
                        "'onednn' (bf16: every matmul on oneDNN, no bf16 decode stack, '<dtype>/onednn'); "
                        "'both' = on,off")
    p.add_argument(BY_NAME["quantization"].flag, default="default",
                   help="comma-separated, run side by side: 'default' (the engine's own choice for the model), "
                        "'none' (dense weights, labelled '<dtype>/dense'), 'gguf' (the GGUF's blocks for small "
                        "decode steps, '<dtype>/gguf')")
    p.add_argument("--output-json", default="bench-results/decode_step.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvpilot bench decode-step`: times one decode step (ms, wall and CPU, median of --rounds)
    per dtype, kernel mode and quantization at each batch size, and writes them with the machine
    block (kvpilot.loadgen.machine) and `--dtype auto`'s choice to --output-json. Returns 0; exits
    2 (argparse) on bad --dtypes, --batch-sizes, --cpu-kernel or --quantization."""
    p = _parser()
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error("--batch-sizes must be comma-separated integers")
    if not dtypes or any(b < 1 for b in batches) or args.steps < 1 or args.rounds < 1:
        p.error("need at least one dtype, batch sizes >= 1, --steps >= 1 and --rounds >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvpilot.engine.cpu.info import choose_cpu_dtype, detect_cpu

    load_before = loadavg()
    modes = ["on", "off"] if args.cpu_kernel == "both" else [m.strip() for m in args.cpu_kernel.split(",")]
    if not modes or any(m not in _MODE_LABEL for m in modes):
        p.error("--cpu-kernel takes comma-separated modes among on, unfused, off, bf16-gemm, onednn (or 'both')")
    quants = [q.strip() for q in args.quantization.split(",") if q.strip()]
    if not quants or any(q not in _QUANT_LABEL for q in quants):
        p.error("--quantization takes comma-separated values among default, none, gguf")
    engines = _engines(args, dtypes, modes, quants, max(batches))
    dtypes = list(engines)
    prompts = _sharegpt_prompts(next(iter(engines.values())).get_tokenizer(), max(batches), args.prompt_len)
    results: dict[str, dict[str, dict]] = {d: {} for d in dtypes}
    for batch in batches:
        for d, row in _time_batch(engines, prompts, batch, args.steps, args.rounds).items():
            results[d][str(batch)] = row
    cpu_info = detect_cpu()
    choice = choose_cpu_dtype(cpu_info)
    out = {"machine": machine_info(loadavg_before=load_before),
           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
           "command": "kvpilot bench decode-step " + " ".join(sys.argv[1:] if argv is None else argv),
           "prompt_len": args.prompt_len, "steps_per_round": args.steps, "rounds": args.rounds,
           "auto_dtype": {"dtype": str(choice.dtype).removeprefix("torch."), "reason": choice.reason},
           "results": results}
    write_result(args.output_json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
