"""One float32 decode stream, stepped by hand, from different threads: libgomp keeps an
OpenMP team per calling thread, and with more OpenMP threads than cores it throttles its
spin-wait (GOMP_SPINCOUNT 1000 when OMP_WAIT_POLICY is unset). Cases: the engine built and
stepped on the main thread; then stepped from a second thread; built and stepped on one
other thread (what `kvpilot serve` does since engine_thread.py). Prints the median step ms.

    .venv/bin/python benchmarks/results/throughput/omp_threads.py > omp_threads_avx2.txt
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

from kvpilot.engine import LLM, SamplingParams

PROMPT = "Write a long story about a dragon who learns to cook."


def stream(engine, tag: str) -> None:
    for rep in range(2):
        engine.add_request(f"{tag}{rep}", PROMPT, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(1000 * (time.perf_counter() - t))
        print(f"{tag}: median step {statistics.median(steps[1:]):.1f} ms (load {os.getloadavg()[0]:.2f})", flush=True)


def build(tag: str):
    return LLM("smollm2-135m-instruct", dtype="float32", max_model_len=2048).engine


def on_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


CASES = {
    "main": lambda: stream(build("main"), "built and stepped on the main thread"),
    "split": lambda: (lambda e: on_thread(lambda: stream(e, "built on the main thread, stepped on another")))(build("split")),
    "one-other": lambda: on_thread(lambda: stream(build("one-other"), "built and stepped on one other thread")),
}


def main() -> None:
    """Each case in a fresh process, so no earlier case's OpenMP team is left over."""
    if len(sys.argv) > 1:
        CASES[sys.argv[1]]()
        return
    for case in CASES:
        subprocess.run([sys.executable, __file__, case], check=True)


if __name__ == "__main__":
    main()
