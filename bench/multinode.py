"""`kvpilot bench multinode`: one engine in one process against the same engine spread over
several `kvpilot serve` processes on this machine, each a node as a pod runs it (`--nnodes N
--node-rank R --master-addr 127.0.0.1 --master-port P`, nodes > 0 headless).

    kvpilot bench multinode --layouts 1x1x1 1x2x2 3x1x3 --output-json OUT.json

A layout is TPxPPxNNODES: 1x2x2 puts pipeline stage 1 on a second process, 3x1x3 splits every
layer over three (SmolLM2's 9 heads and 3 KV heads divide by 3, not by 2). Per layout:
- ready_s: from spawning the processes (nodes > 0 first, as pods start in any order) to node
  0's /health 200, which needs every rank joined, loaded and the KV cache sized;
- out_tok_s, ms/step and the share of step time in torch.distributed (comm_stats) of the
  driver and of the busiest rank: N ShareGPT prompts, max_tokens each (greedy, ignore_eos),
  with this process as node 0 (`bench/tensor_parallel.py`'s run);
- restart_s: kill -9 node N-1 (the only process with one node) after a completion, node 0
  exits 5 by itself once the node is silent for KVPILOT_NODE_TIMEOUT_S (5), then every process
  starts again as a StatefulSet's pods would, until a completion succeeds: kill to serving.
Each process gets cores / nnodes threads (OMP_NUM_THREADS), as pods with that many CPUs
would: on one machine the processes share its cores. The JSON records the CPU, the load
averages before and after, the commit and every figure. Not run in CI.
Source: vLLM's multi-node serving without Ray (docs "Parallelism and Scaling").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from kvpilot.bench.harness.node_group import NodeGroup
from kvpilot.bench.tensor_parallel import run, shares
from kvpilot.engine.settings import BY_NAME, to_flags
from kvpilot.loadgen.datasets import sharegpt_pairs
from kvpilot.loadgen.machine import machine_info


def parse_layout(text: str) -> tuple[int, int, int]:
    """'1x2x2' -> (tensor_parallel_size 1, pipeline_parallel_size 2, nnodes 2). Raises
    ValueError unless nnodes divides tp x pp."""
    tp, pp, nnodes = (int(x) for x in text.split("x"))
    if (tp * pp) % nnodes:
        raise ValueError(f"layout {text}: nnodes {nnodes} must divide tp x pp = {tp * pp}")
    return tp, pp, nnodes


def _serves(url: str) -> bool:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"model": "m", "prompt": "Hello", "max_tokens": 4})
    return r.status_code == 200


def serving_times(model: str, tp: int, pp: int, nnodes: int, dtype: str, log_dir: Path) -> dict:
    """ready_s of a fresh start, and restart_s: kill -9 to serving again after every process
    restarted (node 0 first exits by itself when a node > 0 was killed)."""
    flags = to_flags({"served_model_name": "m", "dtype": dtype, "device": "cpu", "tensor_parallel_size": tp,
                      "pipeline_parallel_size": pp, "max_model_len": 1024, "num_gpu_blocks_override": 256,
                      "swap_space": 0})
    group = NodeGroup(model, flags, nnodes, log_dir)
    try:
        group.start()
        ready_s = group.ready_s
        assert _serves(group.url), "no completion after start"
        t0 = time.monotonic()
        if nnodes > 1:
            group.workers[-1].kill(signal.SIGKILL)
            node0_exit = group.node0_exit_code(60)
        else:
            group.server.proc.kill()
            node0_exit = group.server.proc.wait(30)
        detected_s = time.monotonic() - t0
        group.stop()
        group.start()
        assert _serves(group.url), "no completion after restart"
        restart_s = time.monotonic() - t0
    finally:
        group.stop()
    return {"ready_s": ready_s, "restart_s": restart_s, "node0_exit_after_kill": node0_exit,
            "node0_exit_s": detected_s}


def main(argv: list[str] | None = None) -> None:
    """`kvpilot bench multinode`: for each TPxPPxNNODES layout, offline throughput (output tok/s,
    ms per step, communication shares) and serving times (ready, restart after a node is lost, s),
    written to --output-json with the machine block (kvpilot.loadgen.machine). Exits 2
    (argparse) on a malformed layout."""
    parser = argparse.ArgumentParser(prog="kvpilot bench multinode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--layouts", nargs="+", default=["1x1x1", "1x2x2", "3x1x3"], help="TPxPPxNNODES")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(BY_NAME["dtype"].flag, default="bfloat16")
    parser.add_argument("--output-json", default="multinode.json")
    ns = parser.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in ns.layouts]
    except ValueError as exc:
        parser.error(str(exc))
    prompts = [p[:800] for p, _ in sharegpt_pairs()][: ns.num_prompts]
    cores = len(os.sched_getaffinity(0))
    report = {"machine": machine_info(), "model": ns.model,
              "dtype": ns.dtype, "num_prompts": ns.num_prompts, "max_tokens": ns.max_tokens,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "layouts": []}
    print(f"{'TPxPPxN':>8} {'ready s':>8} {'out tok/s':>10} {'ms/step':>8} {'comm (driver)':>14} "
          f"{'comm (max rank)':>16} {'restart s':>10}")
    for tp, pp, nnodes in layouts:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nnodes))  # every process, as a pod's CPUs
        with tempfile.TemporaryDirectory(prefix="kvpilot-multinode-") as tmp:
            r = run(ns.model, tp, pp, prompts, ns.max_tokens, ns.dtype, nnodes=nnodes, log_dir=Path(tmp))
            served = serving_times(ns.model, tp, pp, nnodes, ns.dtype, Path(tmp))
        s = shares(r)
        row = {"layout": f"{tp}x{pp}x{nnodes}", "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
               "nnodes": nnodes, "threads_per_process": int(os.environ["OMP_NUM_THREADS"]),
               "out_tok_s": r["tokens_per_s"], "wall_s": r["wall_s"], "steps": r["steps"],
               "ms_per_step": 1000 * r["step_s"] / max(1, r["steps"]), "comm_share_driver": s["driver"],
               "comm_share_max_rank": s["max_rank"], "comm_s_by_rank": r["comm"], **served}
        report["layouts"].append(row)
        print(f"{row['layout']:>8} {row['ready_s']:>8.1f} {row['out_tok_s']:>10.1f} {row['ms_per_step']:>8.1f} "
              f"{row['comm_share_driver']:>14.1%} {row['comm_share_max_rank']:>16.1%} {row['restart_s']:>10.1f}",
              flush=True)
    os.environ.pop("OMP_NUM_THREADS", None)
    report["machine"] = machine_info(loadavg_before=report["machine"]["loadavg"])
    Path(ns.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.output_json).write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    print(f"CPU {m['cpu']} ({m['cores']} cores); load average before {m['loadavg_before']}, after "
          f"{m['loadavg_after']}; JSON: {ns.output_json}")


if __name__ == "__main__":
    main()
