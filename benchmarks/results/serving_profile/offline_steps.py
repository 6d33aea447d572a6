"""The 64-concurrent ShareGPT run of issue 49 offline, step by step: the engine that `kvpilot serve -q none
--no-enable-prefix-caching` runs (LLMEngine in process, no HTTP), 128 ShareGPT requests (seed 0, max_tokens
128, temperature 1 as vLLM's client leaves it), max_num_seqs 64, after 8 warm-up requests. Each step's
scheduled tokens, sequences, prompt tokens and wall time are recorded; prints the run's wall time, the
time in steps with a prompt chunk ("mixed") and in decode-only steps, decode steps by batch size, and
writes the steps and the machine block as JSON.

    python -P benchmarks/results/serving_profile/offline_steps.py --out steps.json [--zero-fresh-blocks]

Environment as the engine reads it (e.g. KVPILOT_ADAPTIVE_THREADS=0 turns the thread adapter off).
`--zero-fresh-blocks` makes the runner zero each fresh KV block at its first use, as it did before the
CPU pool moved to zero pages (engine/cpu/zero_pages.py): the A/B of that change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import kvpilot.engine  # noqa: F401  (the engine's OpenMP wait policy is set before torch loads)
import torch

from kvpilot.engine import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.loadgen.datasets import sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="offline_steps.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--zero-fresh-blocks", action="store_true")
    a = p.parse_args()
    before = loadavg()
    torch.set_num_threads(a.threads)
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", quantization="none", max_num_seqs=64, max_model_len=2048,
              enable_prefix_caching=False)
    engine = llm.engine
    if a.zero_fresh_blocks:
        engine.runner._zero_fresh_blocks = True
    requests = sample_sharegpt_requests(llm.get_tokenizer(), 128, seed=0, output_len=128)
    for i, r in enumerate(requests[:8]):
        engine.add_request(f"warm{i}", r.prompt, SamplingParams(temperature=1.0, max_tokens=16))
    while engine.has_unfinished_requests():
        engine.step()
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt, SamplingParams(temperature=1.0, max_tokens=128))
    steps = []  # (scheduled tokens, sequences, prompt tokens, seconds)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        stats = engine.last_step
        steps.append((sum(n for n, _, _ in stats.batch), len(stats.batch), stats.num_prompt_tokens,
                      time.perf_counter() - t))
    wall_s = time.perf_counter() - start
    mixed = [s for s in steps if s[2]]
    decode = [s for s in steps if not s[2]]
    print(f"wall {wall_s:.2f} s, {len(steps)} steps; mixed {len(mixed)} steps {sum(s[3] for s in mixed):.2f} s "
          f"({sum(s[2] for s in mixed)} prompt tokens); decode-only {len(decode)} steps {sum(s[3] for s in decode):.2f} s")
    print("| decode rows | steps | median ms | total s |\n|---|---:|---:|---:|")
    for lo, hi in ((1, 16), (16, 32), (32, 48), (48, 65)):
        sel = [s[3] for s in decode if lo <= s[1] < hi]
        if sel:
            print(f"| {lo}-{hi - 1} | {len(sel)} | {statistics.median(sel) * 1e3:.1f} | {sum(sel):.2f} |")
    with open(a.out, "w") as f:
        json.dump({"machine": machine_info(before), "threads": a.threads,
                   "zero_fresh_blocks": a.zero_fresh_blocks, "wall_s": wall_s,
                   "steps": [{"tokens": s[0], "seqs": s[1], "prompt_tokens": s[2], "s": s[3]} for s in steps]}, f)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
