"""float32 oneDNN weight packing on CPU, A/B in one process: the same ShareGPT requests
through an engine with packed weights (the default) and one without (F.linear, MKL sgemm),
in the order packed, plain, plain, packed (so drift in the machine's speed cancels in the
medians), plus the float32 matmul peak through each path. Prints a table, writes JSON.

    .venv/bin/python benchmarks/results/throughput/ab_fp32_packing.py [num_prompts] [out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from kvpilot.bench.datasets import sample_sharegpt_requests
from kvpilot.bench.throughput import measure_matmul_peak_gflops, run_ours
from kvpilot.engine import LLM, SamplingParams, model_runner
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers import linear


def peak_gflops(pack: bool) -> float:
    """bench throughput's peak (its engine linear path), with or without packing."""
    original = linear.pack_weights_for_cpu
    linear.pack_weights_for_cpu = original if pack else (lambda model: 0)
    try:
        return measure_matmul_peak_gflops(torch.float32)
    finally:
        linear.pack_weights_for_cpu = original


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    out = sys.argv[2] if len(sys.argv) > 2 else "ab_fp32_packing.json"
    original = model_runner.pack_weights_for_cpu
    engines = {}
    for name, pack in (("packed", True), ("plain", False)):
        model_runner.pack_weights_for_cpu = original if pack else (lambda model: 0)
        engines[name] = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=2048)
        engines[name].generate("warm up", SamplingParams(max_tokens=8))
    model_runner.pack_weights_for_cpu = original
    requests = sample_sharegpt_requests(engines["packed"].get_tokenizer(), n, seed=0)
    output_tokens = sum(r.expected_output_len for r in requests)
    total_tokens = output_tokens + sum(r.prompt_len for r in requests)
    runs: dict[str, list[float]] = {"packed": [], "plain": []}
    loads = [os.getloadavg()[0]]
    for name in ("packed", "plain", "plain", "packed"):
        runs[name].append(run_ours(engines[name], requests))
        loads.append(os.getloadavg()[0])
        print(f"{name}: {runs[name][-1]:.1f} s (load {loads[-1]:.2f})", flush=True)
    peaks = {"packed": peak_gflops(True), "plain": peak_gflops(False)}
    res = {"cpu": detect_cpu().as_dict(), "torch_threads": torch.get_num_threads(), "num_prompts": n,
           "output_tokens": output_tokens, "total_tokens": total_tokens, "runs_s": runs, "loadavg_1min": loads,
           "matmul_peak_gflops": peaks}
    print(f"| float32 weights | median s | output tok/s | total tok/s | matmul peak GFLOP/s (M=256) |")
    print("|---|---:|---:|---:|---:|")
    for name in ("plain", "packed"):
        s = statistics.median(runs[name])
        res[name] = {"median_s": s, "output_tokens_per_s": output_tokens / s, "total_tokens_per_s": total_tokens / s}
        print(f"| {name} | {s:.1f} | {output_tokens / s:.1f} | {total_tokens / s:.1f} | {peaks[name]:.1f} |")
    res["packed_over_plain"] = res["packed"]["output_tokens_per_s"] / res["plain"]["output_tokens_per_s"]
    print(f"packed / plain output tokens/s: {res['packed_over_plain']:.2f}x")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
