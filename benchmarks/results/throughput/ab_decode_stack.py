"""The C decode stack (engine/layers/cpu_decode_stack.py) against the per-module path, A/B in one
process: one engine, `DecodeStack.enabled` switched between alternate runs of the same greedy
requests (300-token prompts, `ignore_eos`), best of ROUNDS per side. A case's decode time is its
run's time less that of the same requests with max_tokens=1 (the prefill and the first token),
reported per decode step; both sides produce the same tokens (checked). Prints a table, writes
JSON with the CPU and load averages.
bf16 needs the bf16 matmul kernel (AVX512_BF16, no AMX); DTYPE=float32 runs `--quantization gguf`.

    DTYPE=bfloat16 ROUNDS=5 .venv/bin/python benchmarks/results/throughput/ab_decode_stack.py [out.json]
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu_info import detect_cpu
from kvpilot.engine.layers.cpu_decode_stack import DecodeStack

DTYPE = os.environ.get("DTYPE", "bfloat16")
ROUNDS = int(os.environ.get("ROUNDS", "5"))
CASES = {"1 sequence x 128 tokens": (1, 128), "8 sequences x 96 tokens": (8, 96), "24 sequences x 64 tokens": (24, 64)}


def engine() -> LLM:
    quantization = "gguf" if DTYPE == "float32" else None
    llm = LLM("smollm2-135m-instruct", dtype=DTYPE, max_model_len=1024, max_num_seqs=32, quantization=quantization)
    if llm.engine.runner.model.decode_stack is None:
        raise SystemExit(f"no decode stack serves {DTYPE} here (see the engine's start-up log)")
    return llm


def timed(llm: LLM, n: int, tokens: int, stack: bool) -> tuple[float, list]:
    prompts = [list(range(200 + 13 * i, 200 + 13 * i + 300)) for i in range(n)]  # 300-token contexts
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    DecodeStack.enabled = stack
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, [params] * n)
        return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]
    finally:
        DecodeStack.enabled = True


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "ab_decode_stack.json"
    load_before = os.getloadavg()
    llm = engine()
    sides = {"stack": True, "modules": False}
    rows = []
    for case, (n, tokens) in CASES.items():
        best = {name: float("inf") for name in sides}
        for _ in range(ROUNDS):
            tokens_of = {}
            for name, stack in sides.items():
                seconds, tokens_of[name] = timed(llm, n, tokens, stack)
                best[name] = min(best[name], seconds - timed(llm, n, 1, stack)[0])
            if tokens_of["stack"] != tokens_of["modules"]:
                raise SystemExit(f"{case}: the stack's tokens differ from the modules'")
        ms = {name: 1e3 * best[name] / (tokens - 1) for name in sides}
        rows.append({"case": case, **{f"{k}_ms_per_step": v for k, v in ms.items()},
                     "speedup": ms["modules"] / ms["stack"]})
        print(f"| {case} | {ms['modules']:.1f} | {ms['stack']:.1f} | {rows[-1]['speedup']:.3f} |", flush=True)
    json.dump({"dtype": DTYPE, "rounds": ROUNDS, "threads": torch.get_num_threads(), "cpu": detect_cpu().as_dict(),
               "rows": rows, "loadavg_before": load_before,
               "loadavg_after": os.getloadavg()}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
