"""A rank's side of the multi-process engine: joining the process groups, and the command
loop of the spawned worker ranks (every rank but the driver).

The driver broadcasts `(command, args)` over a gloo control group; each worker runs it on
its StageRunner. Commands: `execute` (a StepInput), `initialize_kv_cache`, `profile`
(answers its RankMemory with a gather to the driver), `comm_stats` (answers its
communication seconds), `shutdown`. A worker exits when its parent (the driver) disappears,
and exits with code 1 after logging one line when a command fails (typically because a peer
died), so the driver can tell the rank that died first (killed by a signal) from those that
followed it. Every worker rank also beats through the driver's rendezvous store
(engine/distributed/rendezvous.py) and exits (code 5, with the reason) as soon as the driver is gone or
has stopped the engine, even while idle and on another node. Source: vLLM
`vllm/v1/executor/multiproc_executor.py` (`WorkerProc`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu.threads import configure_cpu_threads
from kvpilot.engine.exit_codes import EXIT_ENGINE_DIED, report_failure
from kvpilot.engine.distributed.parallel_layout import RankPosition
from kvpilot.engine.distributed.pipeline import MicroBatchPolicy
from kvpilot.engine.distributed.rendezvous import Heartbeat, Rendezvous, abort_reason, describe_rank, rendezvous_timeout_s
from kvpilot.engine.worker.stage_runner import StageRunner
from kvpilot.engine.settings.env import KVPILOT_TP_TIMEOUT_S

CONTROL_TIMEOUT = timedelta(days=7)  # an idle server sends no command for as long as it likes


def collective_timeout() -> timedelta:
    """Bound on a blocked collective or transfer (KVPILOT_TP_TIMEOUT_S, default 60 s)."""
    return timedelta(seconds=float(os.environ.get(KVPILOT_TP_TIMEOUT_S, "60")))


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One device per rank on CUDA (cuda:<local rank>: its index on its node); CPU ranks share the host."""
    if config.device.startswith("cuda"):
        local_rank = config.parallel.local_rank(rank)
        torch.cuda.set_device(local_rank)
        return dataclasses.replace(config, device=f"cuda:{local_rank}")
    return config


def lost_peers(rank_text: str, reason: str) -> None:
    """Ends a worker rank's process that lost the driver or a peer: one line saying why and
    the JSON failure line (exit code 5, engine_died), then exit without cleanup (a collective
    may hold the main thread)."""
    print(f"kvpilot {rank_text} (pid {os.getpid()}) stops: {reason}", file=sys.stderr, flush=True)
    report_failure(EXIT_ENGINE_DIED, f"{rank_text} stopped: {reason}")
    os._exit(EXIT_ENGINE_DIED)


class JoinedRank(NamedTuple):
    """A rank that has joined: its StageRunner, the gloo control group, the rendezvous store
    (on rank 0 the store's server: keep it referenced while other ranks may read it) and, on
    worker ranks, the heartbeat (stop it before a clean exit)."""

    runner: StageRunner
    control: dist.ProcessGroup
    store: dist.TCPStore
    heartbeat: Heartbeat | None


def init_rank(config: EngineConfig, rank: int, micro_batching: MicroBatchPolicy) -> JoinedRank:
    """Joins the rendezvous at config.parallel's master_addr:master_port (rank 0 hosts it;
    waits for every rank, engine/distributed/rendezvous.py), starts a worker rank's heartbeat, joins the
    world (NCCL on CUDA, gloo on CPU), creates the tensor- and pipeline-parallel groups and
    the gloo control group, and builds this rank's StageRunner (its stage's layers, its
    shards). Raises RuntimeError when the ranks do not all join in time."""
    parallel = config.parallel
    world = parallel.world_size
    store = Rendezvous(parallel, rank).join()
    heartbeat = None
    if rank != 0:
        heartbeat = Heartbeat(parallel, rank, lambda reason: lost_peers(describe_rank(parallel, rank), reason))
        heartbeat.start()
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, world_size=world, rank=rank, timeout=collective_timeout())
    control = dist.new_group(list(range(world)), backend="gloo", timeout=CONTROL_TIMEOUT)
    position = RankPosition.of(rank, parallel)
    parallel_state.init_model_parallel(position)
    runner = StageRunner(_rank_config(config, rank), position, micro_batching)
    # every rank has loaded before the first collective with the bounded timeout (a pod whose
    # weights load slower than the others' would otherwise time out the driver's profiling
    # step); bounded by the rendezvous timeout, naming the ranks that never got there
    dist.monitored_barrier(group=control, timeout=timedelta(seconds=rendezvous_timeout_s()), wait_all_ranks=True)
    return JoinedRank(runner, control, store, heartbeat)


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


def worker_main(config: EngineConfig, rank: int, parent_pid: int, micro_batching: MicroBatchPolicy) -> None:
    """Entry point of a spawned rank (multiprocessing 'spawn' target)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if config.device == "cpu":  # the process's CPUs (cpuset, quota) shared by this node's ranks
        configure_cpu_threads(config.parallel.ranks_per_node, config.parallel.local_rank(rank))
    try:
        run_rank(config, rank, micro_batching)
    except Exception as exc:  # a failed collective, usually a dead peer: the driver reports
        print(f"kvpilot worker {describe_rank(config.parallel, rank)} (pid {os.getpid()}) stops: "
              f"{type(exc).__name__}: {exc}{driver_reason(config)}", file=sys.stderr, flush=True)
        os._exit(1)


def run_rank(config: EngineConfig, rank: int, micro_batching: MicroBatchPolicy,
             joined: threading.Event | None = None) -> None:
    """A worker rank from joining to the driver's `shutdown` (returns) or a failure (raises);
    `joined` is set once it has joined and loaded its shard."""
    me = init_rank(config, rank, micro_batching)
    if joined is not None:
        joined.set()
    _serve(me.runner, me.control, config.parallel.world_size)
    me.heartbeat.stop()  # the driver shut down: its store goes with it
    dist.destroy_process_group()


def driver_reason(config: EngineConfig) -> str:
    """' (the driver stopped the engine: <reason>)' when the driver left an abort reason, else ''."""
    reason = abort_reason(config.parallel)
    return f" (the driver stopped the engine: {reason})" if reason else ""


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
