"""The multi-process executor: the driver (rank 0, this process) plus one spawned worker
process per extra rank of a tensor x pipeline parallel engine, each holding its stage's
layers, its tensor-parallel shards and their paged KV cache (engine/worker/stage_runner.py).

The scheduler and block manager stay on the driver. Each step the driver broadcasts the
step's inputs as plain data (`StepInput`) over a gloo control group; every rank runs its
part: within a stage RowParallelLinear all-reduces and the LM head all-gathers the
vocabulary, between stages activations go point to point (engine/distributed/pipeline.py), and the
last stage sends the logits to the driver, which samples with the same sampler as one
process.

    driver (rank 0)                       worker (rank r)
    schedule() -> StepInput ──broadcast──> StepInput
    stage 0 forward ── all-reduce (stage) ── ...   stage s forward ── isend/irecv ──> stage s+1
    sample (logits from the last stage)   wait for the next command

Pipeline micro-batches per step: engine/distributed/pipeline.py (`MicroBatchPolicy`, environment
KVPILOT_PP_MICRO_BATCHES and KVPILOT_PP_MIN_MICRO_BATCH_TOKENS); what overlaps and what
does not is in engine/worker/stage_runner.py.

Nodes: with `--nnodes N` the world's ranks are spread over N nodes (pods), world / N
contiguous ranks each; this process (node 0) spawns only its own node's ranks, and every
other node runs its ranks headless (engine/executor/headless.py). All ranks meet at node 0's
rendezvous store (master_addr:master_port; a free local port with one node) and build the
process groups over it (engine/distributed/rendezvous.py).

Failure handling: the model-parallel groups have a bounded gloo timeout
(`KVPILOT_TP_TIMEOUT_S`, default 60 s); the control group waits indefinitely because an
idle server sends nothing. Before each command the driver checks that every local worker
process is alive and that every rank's heartbeat still moves (`PeerMonitor`, which also
watches while idle: `check_health()`), and a failed collective or transfer is mapped to the
rank whose process died (one killed by a signal before those that stopped after it) or
went silent, so a dead rank raises RuntimeError naming it instead of hanging. Workers exit
when the driver sends `shutdown`, when their parent process disappears, or when their
heartbeat finds the driver gone.

Sources: vLLM `vllm/v1/executor/multiproc_executor.py` (driver + spawned workers, broadcast
of the scheduler output) and `vllm/distributed/parallel_state.py` (a CPU/gloo group for
control next to the device groups); Shoeybi et al., Megatron-LM (2019), for the layout.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpilot.engine.distributed import parallel_state
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.cpu.threads import configure_cpu_threads
from kvpilot.engine.memory import RankMemory
from kvpilot.engine.worker.model_runner import ModelRunner, SampleResult
from kvpilot.engine.distributed.parallel_layout import RankPosition
from kvpilot.engine.distributed.pipeline import MicroBatchPolicy
from kvpilot.engine.distributed.rendezvous import PeerMonitor, announce_abort, node_timeout_s
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.worker.stage_runner import rank_memory
from kvpilot.engine.worker.step_input import StepInput
from kvpilot.engine.worker.worker import gather_to_driver, init_rank, worker_main

logger = logging.getLogger("kvpilot.engine.executor.multiproc")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    """Drop-in for `ModelRunner` on the driver when tensor_parallel_size x
    pipeline_parallel_size > 1: same `initialize_kv_cache`, `execute`, `sampler`, `device`,
    plus `profile_ranks`, `comm_stats`, `check_health()` and `close()`. Raises RuntimeError
    naming the rank when a worker dies, and when the ranks do not all join in time."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.nnodes == 1:  # one node: a free local port, whatever --master-port says
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                config.parallel, master_addr="127.0.0.1", master_port=_free_port()))
        self.parallel = config.parallel
        self.world_size = config.parallel.world_size
        self._closed = False
        self._error: RuntimeError | None = None
        self._peer_error: RuntimeError | None = None
        self._monitor: PeerMonitor | None = None
        self._saved_threads = torch.get_num_threads()
        micro_batching = MicroBatchPolicy.from_env(config.parallel.pipeline_parallel_size)
        ctx = mp.get_context("spawn")
        self.workers = [  # this node's ranks but the driver; the other nodes start their own
            ctx.Process(target=worker_main, args=(config, rank, os.getpid(), micro_batching),
                        name=f"kvpilot-rank{rank}", daemon=True)
            for rank in config.parallel.local_ranks[1:]
        ]
        for proc in self.workers:
            proc.start()
        atexit.register(self.close)
        try:
            if config.device == "cpu":
                configure_cpu_threads(self.parallel.ranks_per_node, 0)
            self._run_guarded(self._init_driver, config, micro_batching)
            self._monitor = PeerMonitor(self.parallel, self._peer_died)
            self._monitor.start()
        except BaseException:
            self.close()
            raise
        logger.info("%d ranks (tensor_parallel_size %d x pipeline_parallel_size %d; %s): driver pid %d, "
                    "workers %s", self.world_size, self.parallel.tensor_parallel_size,
                    self.parallel.pipeline_parallel_size, self.runner.micro_batching, os.getpid(),
                    [p.pid for p in self.workers])

    def _init_driver(self, config: EngineConfig, micro_batching: MicroBatchPolicy) -> None:
        me = init_rank(config, 0, micro_batching)
        self.runner, self._control, self._store = me.runner, me.control, me.store

    def _peer_died(self, error: RuntimeError) -> None:
        """PeerMonitor's verdict (its thread): recorded here, acted on by the engine's thread."""
        logger.error("%s", error)
        self._peer_error = error

    def check_health(self) -> None:
        """Raises RuntimeError naming the rank when one is gone (the engine calls this while
        idle too, so a dead node fails the server within KVPILOT_NODE_TIMEOUT_S)."""
        self._run_guarded(lambda: None)

    # ------------------------------------------------------- ModelRunner API
    @property
    def device(self) -> torch.device:
        """The driver's torch device."""
        return self.runner.device

    @property
    def sampler(self):
        """The driver's Sampler (the driver samples for every rank)."""
        return self.runner.sampler

    @property
    def kv_caches(self):
        """The driver's per-layer (K, V) caches: its stage's layers, its KV-head shard."""
        return self.runner.kv_caches  # the driver's: its stage's layers, its KV-head shard

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocates num_blocks device and num_swap_blocks host KV blocks on every rank."""
        self._run_guarded(self._command, "initialize_kv_cache", (num_blocks, num_swap_blocks),
                          lambda: self.runner.initialize_kv_cache(num_blocks, num_swap_blocks))

    def profile_ranks(self, max_num_batched_tokens: int, max_num_seqs: int,
                      max_model_len: int) -> list[RankMemory]:
        """Profiles one full step on every rank; returns each rank's RankMemory, in rank order."""
        args = (max_num_batched_tokens, max_num_seqs, max_model_len)
        return self._run_guarded(self._command, "profile", args,
                                 lambda: self._gather(self.runner.memory_report(*args)))

    def comm_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per rank (rank order), host seconds spent in each kind of communication
        ('broadcast', 'all_reduce', 'all_gather', 'p2p') since the last reset."""
        return self._run_guarded(self._command, "comm_stats", reset,
                                 lambda: self._gather(parallel_state.comm_seconds(reset)))

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Broadcasts the step (as StepInput) and runs it on every rank; returns the driver's
        {request_id: (token_id, logprobs)} as ModelRunner.execute. Raises RuntimeError naming a dead rank."""
        step = StepInput.from_scheduler_output(out)
        return self._run_guarded(self._command, "execute", step, lambda: self.runner.execute(out))

    def take_prompt_logprobs(self):
        """The driver's prompt logprobs since the last call (ModelRunner.take_prompt_logprobs)."""
        return self.runner.take_prompt_logprobs()

    # ------------------------------------------------------------ internals
    def _command(self, command: str, args, local):
        t0 = time.perf_counter()
        dist.broadcast_object_list([(command, args)], src=0, group=self._control)
        parallel_state.add_comm_seconds("broadcast", time.perf_counter() - t0)
        return local()

    def _gather(self, value) -> list:
        return gather_to_driver(value, self._control, self.world_size)

    def _dead_worker(self, wait_s: float = 0.0) -> RuntimeError | None:
        deadline = time.monotonic() + wait_s
        while True:
            if self._peer_error is not None:
                return self._peer_error
            dead = [(rank, proc) for rank, proc in enumerate(self.workers, start=1) if not proc.is_alive()]
            if dead:
                # a rank killed by a signal is the cause; ranks that exited 1 stopped after it
                dead.sort(key=lambda item: (item[1].exitcode is not None and item[1].exitcode >= 0, item[0]))
                rank, proc = dead[0]
                pos = RankPosition.of(rank, self.parallel)
                message = (f"rank {rank} (tensor-parallel rank {pos.tp_rank}, pipeline stage {pos.pp_rank}, "
                           f"pid {proc.pid}) died with exit code {proc.exitcode}; the engine cannot continue")
                if len(dead) > 1:
                    message += f" (also stopped: ranks {sorted(r for r, _ in dead[1:])})"
                return RuntimeError(message)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _run_guarded(self, fn, *args):
        """Runs fn unless a rank is known dead; maps a failed collective to the dead rank."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the multi-process executor is closed")
        dead = self._dead_worker()
        if dead is None:
            try:
                return fn(*args)
            except Exception as exc:  # remote ranks: give the heartbeat time to name the silent one
                wait_s = 2.0 if self.parallel.nnodes == 1 else node_timeout_s() + 1.5
                dead = self._dead_worker(wait_s) or RuntimeError(
                    f"a collective or transfer between ranks failed (all {self.world_size} ranks alive): {exc}"
                )
                self._fail(dead)
                raise dead from exc
        self._fail(dead)
        raise dead

    def _fail(self, error: RuntimeError) -> None:
        self._error = error
        logger.error("%s", error)
        announce_abort(self.parallel, str(error))  # the other nodes' ranks log why they stop
        self._teardown(graceful=False)

    def close(self) -> None:
        """Stops every worker (a shutdown command, then terminate after 5 s) and leaves
        the process group. Safe to call twice and after a failure."""
        if self._closed:
            return
        graceful = self._error is None and self._dead_worker() is None and hasattr(self, "runner")
        if graceful:
            if self._monitor is not None:  # the ranks stop beating as they leave
                self._monitor.stop()
            try:
                dist.broadcast_object_list([("shutdown", None)], src=0, group=self._control)
            except Exception:  # a worker died meanwhile: terminate below
                graceful = False
        self._teardown(graceful)

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        atexit.unregister(self.close)
        if self._monitor is not None:
            self._monitor.stop()
        for proc in self.workers:
            proc.join(5.0 if graceful else 0.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may refuse; the process state is reset anyway
                pass
        parallel_state.reset_model_parallel()
        torch.set_num_threads(self._saved_threads)


def create_executor(config: EngineConfig) -> ModelRunner | MultiprocExecutor:
    """A plain ModelRunner for one rank (no processes, no overhead), else the executor."""
    if config.parallel.world_size == 1:
        if config.device == "cpu":
            configure_cpu_threads()  # a pod's CPU limit, not the node's cores
        return ModelRunner(config)
    return MultiprocExecutor(config)


def profile_rank_memory(runner: ModelRunner | MultiprocExecutor, config: EngineConfig) -> list[RankMemory]:
    """Every rank's weights, profiled peak activation and KV bytes per block, rank order."""
    s = config.scheduler
    if isinstance(runner, MultiprocExecutor):
        return runner.profile_ranks(s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len)
    activation = runner.profile_peak_activation_bytes(s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len)
    return [rank_memory(runner, 0, activation)]
