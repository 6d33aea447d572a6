"""A rank's side of the multi-process engine: joining the process groups, and the command
loop of the spawned worker ranks (every rank but the driver).

The driver broadcasts `(command, args)` over a gloo control group; each worker runs it on
its StageRunner. Commands: `execute` (a StepInput), `initialize_kv_cache`, `profile`
(answers its RankMemory with a gather to the driver), `comm_stats` (answers its
communication seconds), `shutdown`. A worker exits when its parent (the driver) disappears,
and exits with code 1 after logging one line when a command fails (typically because a peer
died), so the driver can tell the rank that died first (killed by a signal) from those that
followed it. Source: vLLM `vllm/v1/executor/multiproc_executor.py` (`WorkerProc`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpilot.engine import parallel_state
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu_threads import configure_cpu_threads
from kvpilot.engine.parallel_layout import RankPosition
from kvpilot.engine.pipeline import MicroBatchPolicy
from kvpilot.engine.stage_runner import StageRunner

CONTROL_TIMEOUT = timedelta(days=7)  # an idle server sends no command for as long as it likes


def collective_timeout() -> timedelta:
    """Bound on a blocked collective or transfer (KVPILOT_TP_TIMEOUT_S, default 60 s)."""
    return timedelta(seconds=float(os.environ.get("KVPILOT_TP_TIMEOUT_S", "60")))


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One device per rank on CUDA (cuda:<rank>); CPU ranks share the host."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def init_rank(config: EngineConfig, rank: int, init_method: str,
              micro_batching: MicroBatchPolicy) -> tuple[StageRunner, dist.ProcessGroup]:
    """Joins the world (NCCL on CUDA, gloo on CPU), creates the tensor- and
    pipeline-parallel groups and the gloo control group, and builds this rank's
    StageRunner (its stage's layers, its shards). Returns the runner and the control group."""
    world = config.parallel.world_size
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                            timeout=collective_timeout())
    control = dist.new_group(list(range(world)), backend="gloo", timeout=CONTROL_TIMEOUT)
    position = RankPosition.of(rank, config.parallel)
    parallel_state.init_model_parallel(position)
    return StageRunner(_rank_config(config, rank), position, micro_batching), control


def gather_to_driver(value, control: dist.ProcessGroup, world_size: int) -> list | None:
    """Every rank's `value`, in rank order, on the driver (None on the others)."""
    out = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=control)
    return out


def _watch_parent(parent_pid: int) -> None:
    """A worker whose driver vanished (killed without cleanup) exits instead of lingering."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def worker_main(config: EngineConfig, rank: int, init_method: str, parent_pid: int,
                micro_batching: MicroBatchPolicy) -> None:
    """Entry point of a spawned rank (multiprocessing 'spawn' target)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    world = config.parallel.world_size
    if config.device == "cpu":
        configure_cpu_threads(world, rank)  # the process's CPUs (cpuset, quota) shared by the ranks
    try:
        runner, control = init_rank(config, rank, init_method, micro_batching)
        _serve(runner, control, world)
    except Exception as exc:  # a failed collective, usually a dead peer: the driver reports
        print(f"kvpilot worker rank {rank} (pid {os.getpid()}) stops: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


def _serve(runner: StageRunner, control: dist.ProcessGroup, world: int) -> None:
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=control)
        command, args = msg[0]
        if command == "shutdown":
            return
        if command == "execute":
            runner.execute(args.to_scheduler_output())
        elif command == "initialize_kv_cache":
            runner.initialize_kv_cache(*args)
        elif command == "profile":
            gather_to_driver(runner.memory_report(*args), control, world)
        elif command == "comm_stats":
            gather_to_driver(parallel_state.comm_seconds(reset=args), control, world)
        else:
            raise ValueError(f"unknown command {command!r}")
