"""Parallelism benchmark (not run in CI): for each tensor x pipeline parallel size, output
tokens/s and the share of step time each rank spends communicating.

    python -m kvpilot.bench.tensor_parallel --sizes 1x1 3x1 1x2 1x3 --num-prompts 8 --max-tokens 32

A size is TPxPP. Communication per rank is host wall time inside torch.distributed calls
(engine/distributed/parallel_state.py keeps the tally): the step-input broadcast (driver), the
all-reduces and the logits all-gather (tensor parallel), and the point-to-point sends and
receive waits between stages (pipeline parallel). A blocking call's time includes waiting
for the slowest peer, so on the driver of a pipeline the receive wait for the logits also
holds the later stages' compute and the pipeline bubble; the 'p2p' column says how much.
Results and notes on what to expect on GPUs: benchmarks/results/parallel/README.md.
Sources: Megatron-LM (2019) section 3; Huang et al., GPipe (2019); vLLM docs,
"Distributed inference and serving".
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from kvpilot.bench.harness.node_group import HeadlessNode, node_flags
from kvpilot.engine.settings import BY_NAME, to_flags
from kvpilot.engine.settings.env import KVPILOT_PP_MICRO_BATCHES
from kvpilot.loadgen.datasets import sharegpt_pairs
from kvpilot.loadgen.process import KVPILOT_SERVE, free_port


def parse_size(text: str) -> tuple[int, int]:
    """'3x2' -> (tensor_parallel_size 3, pipeline_parallel_size 2); '3' -> (3, 1)."""
    tp, _, pp = text.partition("x")
    return int(tp), int(pp or 1)


def run(model: str, tp: int, pp: int, prompts: list[str], max_tokens: int, dtype: str, nnodes: int = 1,
        log_dir: Path | None = None) -> dict:
    """Generates max_tokens per prompt after a warm-up; returns tokens/s, step count and
    time, and per rank the seconds of each kind of communication during the measured run.
    nnodes > 1: this process is node 0 (the driver, `--node-rank 0`) and nodes 1.. are
    headless `kvpilot serve` processes (logs in log_dir), as pods would run them."""
    from kvpilot.engine import LLM, SamplingParams

    settings = dict(dtype=dtype, device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                    max_model_len=1024, max_num_seqs=len(prompts), num_gpu_blocks_override=64 * len(prompts),
                    swap_space=0)
    nodes, port = [], free_port()
    for rank in range(1, nnodes):
        nodes.append(HeadlessNode([*KVPILOT_SERVE, model, *to_flags(settings), *node_flags(nnodes, rank, port)],
                                  Path(log_dir or ".") / f"node{rank}.log", os.environ))
    if nnodes > 1:
        settings.update(nnodes=nnodes, node_rank=0, master_addr="127.0.0.1", master_port=port)
    llm = LLM(model, **settings)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps = []
    step = engine.step

    def timed_step():
        out = step()
        steps.append(engine.last_step.duration_s)
        return out

    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        comm_stats = getattr(engine.runner, "comm_stats", None)
        if comm_stats:
            comm_stats(reset=True)
        engine.step = timed_step
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        engine.step = step
        comm = comm_stats(reset=True) if comm_stats else [{}]
    finally:
        engine.close()
        for node in nodes:  # the driver's shutdown ends them
            node.wait(30)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tp": tp, "pp": pp, "tokens_per_s": tokens / wall, "wall_s": wall, "steps": len(steps),
            "step_s": sum(steps), "comm": comm}


def shares(result: dict) -> dict:
    """Communication as a share of the summed step time: the driver's total and its
    point-to-point part, and the largest total over ranks."""
    step_s = result["step_s"] or 1.0
    totals = [sum(c.values()) / step_s for c in result["comm"]]
    driver = result["comm"][0]
    return {"driver": totals[0], "driver_p2p": driver.get("p2p", 0.0) / step_s, "max_rank": max(totals)}


def main(argv: list[str] | None = None) -> None:
    """`python -m kvpilot.bench.tensor_parallel`: offline output tok/s, ms per step and the
    communication shares (driver, of it point-to-point, the busiest rank) of each TPxPP size, one
    row per size on stdout. Raises ValueError on a malformed size (parse_size)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sizes", nargs="+", default=["1x1", "3x1", "1x2"], help="TPxPP, e.g. 3x1 1x2 3x2")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="(older spelling) TP sizes, PP 1")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="pipeline micro-batches per step (KVPILOT_PP_MICRO_BATCHES; default: PP size)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of a one-rank run (default: torch's, one per core); "
                             "multi-rank runs give each rank cores // world_size")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(BY_NAME["dtype"].flag, default="bfloat16")
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.micro_batches:
        os.environ[KVPILOT_PP_MICRO_BATCHES] = str(ns.micro_batches)
    sizes = [(tp, 1) for tp in ns.tp] if ns.tp else [parse_size(s) for s in ns.sizes]
    prompts = [p for p, _ in sharegpt_pairs()][: ns.num_prompts]
    prompts = [p[:800] for p in prompts]  # keep prefill short; decode dominates
    print(f"{'TPxPP':>6} {'out tok/s':>10} {'wall s':>7} {'steps':>6} {'ms/step':>8} "
          f"{'comm (driver)':>14} {'of it p2p':>10} {'comm (max rank)':>16}")
    for tp, pp in sizes:
        r = run(ns.model, tp, pp, prompts, ns.max_tokens, ns.dtype)
        s = shares(r)
        print(f"{f'{tp}x{pp}':>6} {r['tokens_per_s']:>10.1f} {r['wall_s']:>7.2f} {r['steps']:>6} "
              f"{1000 * r['step_s'] / max(1, r['steps']):>8.1f} {s['driver']:>14.1%} {s['driver_p2p']:>10.1%} "
              f"{s['max_rank']:>16.1%}", flush=True)


if __name__ == "__main__":
    main()
