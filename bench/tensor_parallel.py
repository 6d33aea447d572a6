"""Tensor-parallel benchmark (not run in CI): output tokens/s per tensor_parallel_size and
the driver's share of step time spent in communication (the step-input broadcast plus the
all-reduces and the logits all-gather; a collective's time includes waiting for the slowest
rank, so it also measures imbalance).

    python -m kvpilot.bench.tensor_parallel --tp 1 3 --num-prompts 8 --max-tokens 32

What to expect: on a CPU host all ranks share the same cores and memory bandwidth, so TP
mostly adds gloo round trips (two all-reduces per layer over TCP loopback) and is slower
than one process; it only pays where each rank has its own device. On GPUs with NVLink,
Megatron-style TP of a small model is latency-bound by the 2 x num_layers all-reduces per
step (a few microseconds each with NCCL), and large models scale close to linearly in
weight-bandwidth-bound decode (vLLM reports TP for models that do not fit one GPU).
Sources: Megatron-LM (2019) section 3; vLLM docs, "Distributed inference and serving".
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from kvpilot.bench.datasets import sharegpt_pairs


class CommTimer:
    """Wraps torch.distributed's all_reduce / all_gather in this process to sum their time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved = {}

    def __enter__(self) -> CommTimer:
        for name in ("all_reduce", "all_gather"):
            fn = getattr(dist, name)
            self._saved[name] = fn

            def timed(*args, _fn=fn, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0

            setattr(dist, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def run(model: str, tp: int, prompts: list[str], max_tokens: int, dtype: str) -> dict:
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device="cpu", tensor_parallel_size=tp, max_model_len=1024,
              max_num_seqs=len(prompts), num_gpu_blocks_override=64 * len(prompts), swap_space=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        runner = llm.engine.runner
        bcast0 = getattr(runner, "comm_s", 0.0)
        with CommTimer() as comm:
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
        comm_s = comm.seconds + getattr(runner, "comm_s", 0.0) - bcast0
    finally:
        llm.engine.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tp": tp, "tokens_per_s": tokens / wall, "wall_s": wall, "comm_share": comm_s / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    ns = parser.parse_args(argv)
    prompts = [p for p, _ in sharegpt_pairs()][: ns.num_prompts]
    prompts = [p[:800] for p in prompts]  # keep prefill short; decode dominates
    print(f"{'tp':>3} {'output tok/s':>13} {'wall s':>8} {'comm share':>11}")
    for tp in ns.tp:
        r = run(ns.model, tp, prompts, ns.max_tokens, ns.dtype)
        print(f"{r['tp']:>3} {r['tokens_per_s']:>13.1f} {r['wall_s']:>8.2f} {r['comm_share']:>10.1%}")


if __name__ == "__main__":
    main()
