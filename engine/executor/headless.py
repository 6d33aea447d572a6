"""A node other than node 0 (`kvpilot serve --nnodes N --node-rank R`, R > 0, with or
without `--headless`): this node's ranks of the engine, and no HTTP server, as vLLM's
`run_headless` runs a follower node's `MultiprocExecutor`.

The process runs the node's first rank itself (on a thread of its own, so that SIGTERM is
handled while that rank waits in a collective) and spawns the node's other ranks; the
driver (rank 0 on node 0) schedules every step and sends each rank its inputs.

Exit codes (engine/exit_codes.py, with the JSON line on stderr):
    0  the driver shut the engine down, or SIGTERM / SIGINT here
    1  the rendezvous failed (node 0 unreachable or the others late past
       KVPILOT_RENDEZVOUS_TIMEOUT_S, or node 0 refused this node), or loading failed
    5  the engine was running and this node lost the driver or a peer, or one of its own
       ranks died; the log line says which and why (engine/distributed/rendezvous.py's heartbeat ends the
       process within KVPILOT_NODE_TIMEOUT_S even while the rank idles)
Source: vLLM `vllm/entrypoints/cli/serve.py` (`run_headless`), `vllm/v1/executor/multiproc_executor.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch.multiprocessing as mp

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu.threads import configure_cpu_threads
from kvpilot.engine.exit_codes import EXIT_FAILED, EXIT_OK, report_failure
from kvpilot.engine.distributed.pipeline import MicroBatchPolicy
from kvpilot.engine.distributed.rendezvous import describe_rank
from kvpilot.engine.worker.worker import driver_reason, lost_peers, run_rank, worker_main

logger = logging.getLogger("kvpilot.engine.executor.headless")


class _OwnRank(threading.Thread):
    """The node's first rank, run in this process; `error` holds why it stopped, if it failed."""

    def __init__(self, config: EngineConfig, rank: int, micro_batching: MicroBatchPolicy) -> None:
        super().__init__(name=f"kvpilot-rank{rank}", daemon=True)
        self.config, self.rank, self.micro_batching = config, rank, micro_batching
        self.joined = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        if self.config.device == "cpu":  # the thread that runs the steps gets the rank's threads
            parallel = self.config.parallel
            configure_cpu_threads(parallel.ranks_per_node, parallel.local_rank(self.rank))
        try:
            run_rank(self.config, self.rank, self.micro_batching, self.joined)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc


def run_headless(config: EngineConfig) -> int:
    """Runs this node's ranks until the driver shuts them down (returns 0) or something fails
    (exits 1 or 5, see the module's docstring). Signals end the process with 0."""
    parallel = config.parallel
    ranks = parallel.local_ranks
    micro_batching = MicroBatchPolicy.from_env(parallel.pipeline_parallel_size)
    ctx = mp.get_context("spawn")
    children = [ctx.Process(target=worker_main, args=(config, rank, os.getpid(), micro_batching),
                            name=f"kvpilot-rank{rank}", daemon=True) for rank in ranks[1:]]
    for proc in children:
        proc.start()

    def leave(signum, _frame) -> None:
        logger.info("%s: leaving (the driver sees this node go)", signal.Signals(signum).name)
        for proc in children:
            proc.kill()
        os._exit(EXIT_OK)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    own = _OwnRank(config, ranks[0], micro_batching)
    logger.info("node %d of %d, headless: ranks %d-%d (%d in this process, pid %d); driver at %s:%d",
                parallel.node_rank, parallel.nnodes, ranks[0], ranks[-1], ranks[0], os.getpid(), parallel.master_addr,
                parallel.master_port)
    own.start()
    while own.is_alive():
        own.join(0.5)  # returns to the interpreter, so the signal handlers run
        dead = [(rank, proc) for rank, proc in zip(ranks[1:], children) if not proc.is_alive()]
        if dead:
            rank, proc = dead[0]
            lost_peers(f"node {parallel.node_rank}",
                       f"its {describe_rank(parallel, rank)} (pid {proc.pid}) died with exit code {proc.exitcode}")
    if own.error is not None:
        reason = f"{type(own.error).__name__}: {own.error}{driver_reason(config)}"
        if not own.joined.is_set():
            logger.error("%s: %s", describe_rank(parallel, ranks[0]), reason)
            return report_failure(EXIT_FAILED, f"{describe_rank(parallel, ranks[0])} did not start: {reason}")
        lost_peers(describe_rank(parallel, ranks[0]), reason)
    for proc in children:
        proc.join(5.0)
    logger.info("the driver shut the engine down; node %d exits", parallel.node_rank)
    return EXIT_OK
