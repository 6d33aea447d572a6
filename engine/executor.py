"""Tensor-parallel executor: the driver (rank 0, this process) plus one spawned worker
process per extra rank, each holding its shard of the model and of the paged KV cache.

The scheduler and block manager stay on the driver. Each step the driver broadcasts the
step's inputs as plain data (`StepInput`) over a gloo control group; every rank runs the
forward pass (RowParallelLinear all-reduces, the LM head all-gathers the vocabulary), and
only the driver samples, from full-vocabulary logits, with the same sampler as one process.

    driver (rank 0)                       worker (rank r)
    schedule() -> StepInput ──broadcast──> StepInput
    forward ───────── all-reduce per layer ───────── forward
    logits  ───────── all-gather (vocab) ─────────── logits (discarded)
    sample, commit                        wait for the next command

Failure handling: the tensor-parallel group has a bounded gloo timeout
(`KVPILOT_TP_TIMEOUT_S`, default 60 s); the control group waits indefinitely because an
idle server sends nothing. Before each command the driver checks that every worker
process is alive, and a failed collective is mapped to the rank whose process died, so a
dead rank raises RuntimeError naming it instead of hanging. Workers exit when the driver
sends `shutdown` or when their parent process disappears.

Sources: vLLM `vllm/executor/multiproc_executor.py` (driver + spawned workers, broadcast of
the scheduler output) and `vllm/distributed/parallel_state.py` (a CPU/gloo group for
control next to the device group); Shoeybi et al., Megatron-LM (2019), for the layout.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvpilot.engine import parallel_state
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.model_runner import ModelRunner, SampleResult
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import SchedulerOutput

logger = logging.getLogger("kvpilot.engine.executor")

_CONTROL_TIMEOUT = timedelta(days=7)


def collective_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("KVPILOT_TP_TIMEOUT_S", "60")))


@dataclass
class StepSequence:
    """What a worker needs of a scheduled sequence: the tokens it computes this step and
    where their KV goes. Quacks like `Sequence` for `ModelRunner._prepare`."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    is_prefill: bool
    block_table: list[int]
    token_ids: list[int]  # tokens [num_computed_tokens, num_computed_tokens + scheduled)
    sampling_params: SamplingParams

    def token_ids_range(self, start: int, end: int) -> list[int]:
        base = self.num_computed_tokens
        return self.token_ids[start - base : end - base]


@dataclass
class StepInput:
    """A SchedulerOutput as picklable plain data: (sequence, num_scheduled_tokens) pairs
    and the block operations to run before the forward pass."""

    scheduled: list[tuple[StepSequence, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_zero: list[int] = field(default_factory=list)

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> StepInput:
        scheduled = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            scheduled.append((StepSequence(
                seq.request_id, start, seq.num_tokens, seq.is_prefill, list(seq.block_table),
                seq.token_ids_range(start, start + n), seq.sampling_params,
            ), n))
        return cls(scheduled, list(out.blocks_to_swap_out), list(out.blocks_to_swap_in),
                   list(out.blocks_to_copy), list(out.blocks_to_zero))

    def to_scheduler_output(self) -> SchedulerOutput:
        return SchedulerOutput(scheduled=self.scheduled, blocks_to_swap_out=self.blocks_to_swap_out,
                               blocks_to_swap_in=self.blocks_to_swap_in, blocks_to_copy=self.blocks_to_copy,
                               blocks_to_zero=self.blocks_to_zero)


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One device per rank on CUDA (cuda:<rank>); CPU ranks share the host."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _init_rank(config: EngineConfig, rank: int, init_method: str) -> tuple[EngineConfig, dist.ProcessGroup]:
    """Joins the world (NCCL on CUDA, gloo on CPU), sets the tensor-parallel state and
    returns this rank's config and the gloo control group."""
    world = config.parallel.world_size
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                            timeout=collective_timeout())
    control = dist.new_group(list(range(world)), backend="gloo", timeout=_CONTROL_TIMEOUT)
    parallel_state.set_tensor_parallel_group(dist.group.WORLD, world, rank)
    return _rank_config(config, rank), control


def _watch_parent(parent_pid: int) -> None:
    """A worker whose driver vanished (killed without cleanup) exits instead of lingering."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _worker_main(config: EngineConfig, rank: int, init_method: str, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if config.device == "cpu":
        torch.set_num_threads(_threads_per_rank(config.parallel.world_size))
    config, control = _init_rank(config, rank, init_method)
    runner = ModelRunner(config)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=control)
        command, args = msg[0]
        if command == "shutdown":
            break
        if command == "execute":
            runner.execute(args.to_scheduler_output(), sample=False)
        elif command == "initialize_kv_cache":
            runner.initialize_kv_cache(*args)
        elif command == "profile":
            runner.profile_peak_activation_bytes(*args)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """Drop-in for `ModelRunner` on the driver when tensor_parallel_size > 1: same
    `initialize_kv_cache`, `profile_peak_activation_bytes`, `execute`, `sampler`, plus
    `close()`. Raises RuntimeError naming the rank when a worker dies."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.pipeline_parallel_size != 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported yet; use --pipeline-parallel-size 1")
        self.world_size = config.parallel.world_size
        self._closed = False
        self._error: RuntimeError | None = None
        self._saved_threads = torch.get_num_threads()
        self.comm_s = 0.0  # driver time waiting in broadcasts (benchmarks read it)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(target=_worker_main, args=(config, rank, init_method, os.getpid()),
                        name=f"kvpilot-tp-rank{rank}", daemon=True)
            for rank in range(1, self.world_size)
        ]
        for proc in self.workers:
            proc.start()
        atexit.register(self.close)
        try:
            if config.device == "cpu":
                torch.set_num_threads(_threads_per_rank(self.world_size))
            self._run_guarded(self._init_driver, config, init_method)
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks (driver pid %d, workers %s)", self.world_size,
                    os.getpid(), [p.pid for p in self.workers])

    def _init_driver(self, config: EngineConfig, init_method: str) -> None:
        config, self._control = _init_rank(config, 0, init_method)
        self.runner = ModelRunner(config)

    # ------------------------------------------------------- ModelRunner API
    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def weights_bytes(self) -> int:
        return self.runner.weights_bytes  # per rank, as the per-rank KV sizing expects

    @property
    def sampler(self):
        return self.runner.sampler

    @property
    def kv_caches(self):
        return self.runner.kv_caches

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self._run_guarded(self._command, "initialize_kv_cache", (num_blocks, num_swap_blocks),
                          lambda: self.runner.initialize_kv_cache(num_blocks, num_swap_blocks))

    def profile_peak_activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int,
                                      max_model_len: int) -> int:
        args = (max_num_batched_tokens, max_num_seqs, max_model_len)
        return self._run_guarded(self._command, "profile", args,
                                 lambda: self.runner.profile_peak_activation_bytes(*args))

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        step = StepInput.from_scheduler_output(out)
        return self._run_guarded(self._command, "execute", step, lambda: self.runner.execute(out))

    # ------------------------------------------------------------ internals
    def _command(self, command: str, args, local):
        t0 = time.perf_counter()
        dist.broadcast_object_list([(command, args)], src=0, group=self._control)
        self.comm_s += time.perf_counter() - t0
        return local()

    def _dead_worker(self, wait_s: float = 0.0) -> RuntimeError | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.workers, start=1):
                if not proc.is_alive():
                    return RuntimeError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code "
                        f"{proc.exitcode}; the engine cannot continue"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _run_guarded(self, fn, *args):
        """Runs fn unless a rank is known dead; maps a failed collective to the dead rank."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is closed")
        dead = self._dead_worker()
        if dead is None:
            try:
                return fn(*args)
            except Exception as exc:
                dead = self._dead_worker(wait_s=2.0) or RuntimeError(
                    f"a tensor-parallel collective failed (all {self.world_size} ranks alive): {exc}"
                )
                self._fail(dead)
                raise dead from exc
        self._fail(dead)
        raise dead

    def _fail(self, error: RuntimeError) -> None:
        self._error = error
        logger.error("%s", error)
        self._teardown(graceful=False)

    def close(self) -> None:
        """Stops every worker (a shutdown command, then terminate after 5 s) and leaves
        the process group. Safe to call twice and after a failure."""
        if self._closed:
            return
        graceful = self._error is None and self._dead_worker() is None and hasattr(self, "runner")
        if graceful:
            try:
                dist.broadcast_object_list([("shutdown", None)], src=0, group=self._control)
            except Exception:  # a worker died meanwhile: terminate below
                graceful = False
        self._teardown(graceful)

    def _teardown(self, graceful: bool) -> None:
        self._closed = True
        atexit.unregister(self.close)
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
        parallel_state.set_tensor_parallel_group(None, 1, 0)
        torch.set_num_threads(self._saved_threads)


def create_executor(config: EngineConfig) -> ModelRunner | TensorParallelExecutor:
    """A plain ModelRunner for one rank (no processes, no overhead), else the executor."""
    if config.parallel.world_size == 1:
        return ModelRunner(config)
    return TensorParallelExecutor(config)
