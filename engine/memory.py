"""KV-cache sizing: how many blocks fit in gpu_memory_utilization x device memory once the
weights and the peak activation of a profiled step are taken out.

KV cache per token = 2 (K and V) x num_layers x num_kv_heads x head_dim x bytes per element.
The same arithmetic (`KVCachePlan`) serves the engine at startup and the tuner's
feasibility check before it tries a configuration.

With several ranks each holds its stage's layers and its share of the KV heads, so its
bytes per block differ, but block ids are global (one block manager on the driver): every
rank must hold the same number of blocks. On GPUs each rank has its own device, so the
number of blocks is the minimum over ranks of what each device fits. On CPU all ranks
share one machine's memory, so one pool pays for every rank's weights, activations and
its slice of each block. On CPU, device memory is the machine's
memory or the cgroup's limit, whichever is smaller; the peak activation is measured as the
growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs).

On CPU the KV cache is also capped by a fixed space, as vLLM's CPU backend does:
`VLLM_CPU_KVCACHE_SPACE` GiB per rank (unset or 0: 4 GiB), so that a server with defaults
takes 4 GiB of KV cache, not 90% of the machine (two servers, or a server beside a test
suite, fit). The gpu_memory_utilization budget above still bounds it from above.
Sources: vLLM `Worker.determine_available_memory` / `check_enough_kv_cache_memory`;
vLLM `vllm/envs.py` and `vllm/platforms/cpu.py` for VLLM_CPU_KVCACHE_SPACE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.engine.config import ModelConfig, element_bytes, node_ranks

from kvpilot.engine.exit_codes import KVCacheTooSmallError
from kvpilot.engine.settings.env import VLLM_CPU_KVCACHE_SPACE

if TYPE_CHECKING:  # torch loads only where a device is measured: the tuner sizes without it
    import torch

GiB = 1 << 30
CPU_KVCACHE_SPACE_ENV = VLLM_CPU_KVCACHE_SPACE
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4


def cpu_kvcache_space_bytes(environ: dict[str, str]) -> int:
    """Bytes of KV cache per rank on CPU from `VLLM_CPU_KVCACHE_SPACE` (GiB; unset, empty
    or 0 means vLLM's default of 4 GiB). vLLM parses an integer; a fraction is accepted
    here too (small pods). Raises ValueError for a negative or non-numeric value."""
    text = environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    try:
        gib = float(text) if text else 0.0
    except ValueError:
        gib = -1.0
    if gib < 0 or gib != gib:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}={text!r} must be a number of GiB >= 0 (0 or unset: "
                         f"{DEFAULT_CPU_KVCACHE_SPACE_GIB} GiB)")
    return int((gib or DEFAULT_CPU_KVCACHE_SPACE_GIB) * GiB)


def total_device_memory_bytes(device: torch.device) -> int:
    """Bytes of memory on `device`: the GPU's total, or on CPU min(MemTotal, cgroup limit)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[1]
    total = _meminfo_kib("MemTotal") * 1024
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _meminfo_kib(key: str, path: str = "/proc/meminfo") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not found in {path}")


def estimate_activation_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                              tensor_parallel_size: int = 1, with_logits: bool = True) -> int:
    """Rough peak extra memory of one full step on one rank, in bytes: per batched token
    the hidden state, q/k/v and the MLP's gate and up projections in the model's dtype
    (the last three split over tensor_parallel_size; twice, for the input and output of
    the widest op), plus float32 logits for up to max_num_seqs sampled tokens on ranks
    that hold them (with_logits: the last pipeline stage and the driver). On GPUs the
    engine profiles the real value at startup; on CPU, where the KV cache has a fixed
    space (VLLM_CPU_KVCACHE_SPACE), it uses this estimate instead of a full dummy step."""
    elem = element_bytes(model.dtype)
    tp = tensor_parallel_size
    per_token = (model.hidden_size * 2 + ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                                          + 2 * model.intermediate_size) // tp) * elem * 2
    sampled = min(max_num_seqs, max_num_batched_tokens)
    return max_num_batched_tokens * per_token + (sampled * model.vocab_size * 4 if with_logits else 0)


class PeakMemoryProbe:
    """Measures the extra memory a block of code needs at its peak, in bytes.

    CUDA: torch's allocator statistics. CPU: VmHWM after resetting it (Linux), minus the
    resident set before; 0 when the kernel does not allow the reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemoryProbe:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._can_reset = _reset_peak_rss()
            self._before = _meminfo_kib("VmRSS", "/proc/self/status") * 1024
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._before
        elif self._can_reset:
            peak = _meminfo_kib("VmHWM", "/proc/self/status") * 1024
            self.peak_bytes = max(0, peak - self._before)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class KVCacheBudget:
    """The arithmetic of one sizing, kept for the startup log and error messages.

    space_bytes (CPU): each rank's KV cache holds at most this many bytes;
    space_block_bytes is the largest rank's bytes per block, the one the space binds first."""

    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    block_bytes: int
    block_size: int
    space_bytes: int | None = None
    space_block_bytes: int = 0

    @property
    def kv_cache_bytes(self) -> int:
        """What the memory budget leaves for the KV cache (before the CPU space cap)."""
        return max(0, int(self.total_bytes * self.gpu_memory_utilization) - self.weights_bytes - self.activation_bytes)

    @property
    def space_limited(self) -> bool:
        """True when the CPU KV-cache space, not the memory budget, sets the block count."""
        return self.space_bytes is not None and (
            self.space_bytes // self.space_block_bytes < self.kv_cache_bytes // self.block_bytes)

    @property
    def num_blocks(self) -> int:
        """KV blocks this budget allows: the smaller of the memory budget's and the space cap's."""
        if self.space_limited:
            return self.space_bytes // self.space_block_bytes
        return self.kv_cache_bytes // self.block_bytes

    def max_concurrency(self, max_model_len: int) -> float:
        """How many max_model_len sequences fit at once."""
        return self.num_blocks * self.block_size / max_model_len

    def describe(self) -> str:
        """The sizing arithmetic in one line (GiB), for the startup log and error messages."""
        budget = (
            f"device memory {self.total_bytes / GiB:.2f} GiB x gpu_memory_utilization "
            f"{self.gpu_memory_utilization} - weights {self.weights_bytes / GiB:.3f} GiB - peak "
            f"activation {self.activation_bytes / GiB:.3f} GiB = {self.kv_cache_bytes / GiB:.3f} GiB"
        )
        if self.space_limited:
            return (f"KV cache space {self.space_bytes / GiB:.3f} GiB per rank ({CPU_KVCACHE_SPACE_ENV}) "
                    f"= {self.num_blocks} blocks of {self.block_size} tokens; the memory budget allows "
                    f"more: {budget}")
        capped = f" (under the {CPU_KVCACHE_SPACE_ENV} space)" if self.space_bytes is not None else ""
        return f"{budget} = KV cache{capped} ({self.num_blocks} blocks of {self.block_size} tokens)"


@dataclass(frozen=True)
class RankMemory:
    """One rank's share, in bytes: its weights, the peak activation of its profiled step,
    and its KV bytes per block (its stage's layers x its KV-head shard x block_size)."""

    rank: int
    weights_bytes: int
    activation_bytes: int
    block_bytes: int


@dataclass(frozen=True)
class KVCachePlan:
    """How many KV blocks every rank holds. shared_memory (CPU): one KVCacheBudget per
    machine (node, pod) with the weights, activations and block bytes of the ranks it runs
    summed (nnodes machines each run world / nnodes contiguous ranks,
    `config.node_ranks`). Otherwise (one device per rank): one KVCacheBudget per
    rank. The smallest count wins. Source: vLLM `Executor.determine_num_available_blocks`
    (minimum over workers)."""

    budgets: tuple[KVCacheBudget, ...]
    ranks: tuple[RankMemory, ...]
    shared_memory: bool
    nnodes: int = 1

    @classmethod
    def build(cls, total_bytes: int, gpu_memory_utilization: float, block_size: int,
              ranks: list[RankMemory], shared_memory: bool, space_bytes: int | None = None,
              nnodes: int = 1) -> KVCachePlan:
        """total_bytes: memory of one device (shared_memory=False) or of one machine.
        space_bytes: the CPU cap on each rank's KV cache (None: no cap). nnodes: machines
        the ranks are spread over (shared_memory only; each has total_bytes). Raises
        ValueError when nnodes does not divide the number of ranks."""
        space_block = max(r.block_bytes for r in ranks)

        def budget(group):
            return KVCacheBudget(total_bytes, gpu_memory_utilization, sum(r.weights_bytes for r in group),
                                 sum(r.activation_bytes for r in group), sum(r.block_bytes for r in group),
                                 block_size, space_bytes, space_block)
        if shared_memory or len(ranks) == 1:
            budgets = tuple(budget([ranks[i] for i in node_ranks(len(ranks), nnodes, node)])
                            for node in range(nnodes))
        else:
            budgets = tuple(budget([r]) for r in ranks)
        return cls(budgets, tuple(ranks), shared_memory, nnodes)

    @property
    def limiting(self) -> int:
        """Index into `budgets` (and, per device, `ranks`) of the budget with fewest blocks."""
        return min(range(len(self.budgets)), key=lambda i: self.budgets[i].num_blocks)

    @property
    def num_blocks(self) -> int:
        """KV blocks every rank holds: the limiting budget's count (vLLM's minimum over workers)."""
        return self.budgets[self.limiting].num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes one block id costs over all ranks (the whole model's KV for block_size tokens)."""
        return sum(r.block_bytes for r in self.ranks)

    def describe(self) -> str:
        """The limiting budget's arithmetic in one line, with how the ranks share memory and each
        rank's KiB per block."""
        budget = self.budgets[self.limiting]
        if len(self.ranks) == 1:
            return budget.describe()
        per_rank = ", ".join(f"rank {r.rank}: {r.block_bytes / 1024:.0f}" for r in self.ranks)
        if len(self.budgets) == 1:
            return (f"{len(self.ranks)} ranks share one memory; summed over them: {budget.describe()}; "
                    f"KiB per block by rank: {per_rank}")
        if self.shared_memory:
            held = node_ranks(len(self.ranks), self.nnodes, self.limiting)
            return (f"{len(held)} rank(s) per node over {self.nnodes} nodes; node {self.limiting} (ranks "
                    f"{held.start}-{held.stop - 1}) has the fewest blocks, summed over its ranks: "
                    f"{budget.describe()}; KiB per block by rank: {per_rank}")
        rank = self.ranks[self.limiting].rank
        return (f"rank {rank} has the fewest blocks, every rank holds that many: {budget.describe()}; "
                f"KiB per block by rank: {per_rank}")


def check_fits(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int, how: str) -> None:
    """Raises KVCacheTooSmallError (a ValueError), with the numbers, when one max_model_len
    sequence does not fit."""
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks >= needed_blocks:
        return
    raise KVCacheTooSmallError(
        f"To serve one request of max_model_len ({max_model_len} tokens), {needed_blocks} KV blocks "
        f"({needed_blocks * block_bytes / GiB:.3f} GiB) are needed, but only {num_blocks} blocks "
        f"({num_blocks * block_bytes / GiB:.3f} GiB) are available: {how}. The largest max_model_len "
        f"that fits is {num_blocks * block_size}. Increase gpu_memory_utilization (on CPU also "
        f"{CPU_KVCACHE_SPACE_ENV}, GiB) or the parallel sizes, or decrease max_model_len."
    )
