"""Engine configuration: one frozen dataclass per concern, with vLLM's names and defaults.

Validation happens in `__post_init__` and raises `ValueError` saying what to change; the
bounds, defaults and rules come from `kvpilot.engine.settings`. No I/O here: the model's
shape (`ModelConfig`) is read by the loader and passed in.
Sources: vLLM `vllm/config` (CacheConfig, SchedulerConfig, ParallelConfig) and vLLM's
performance-tuning guide for the chunked-prefill rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from kvpilot.engine import settings
from kvpilot.engine.settings import default_max_num_batched_tokens


def _default(name: str):
    return settings.BY_NAME[name].default


# `--dtype` spellings -> canonical name (torch's attribute name). Names, not torch dtypes, so
# that the tuner and the operator can size a model without importing torch.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name ('float32', 'bfloat16', 'float16') of a `--dtype` value or a
    torch dtype. Raises ValueError on an unknown name."""
    if not isinstance(dtype, str):
        return str(dtype).removeprefix("torch.")
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)} or 'auto'") from None


def element_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a dtype name or torch dtype (torch-free for names)."""
    if not isinstance(dtype, str):
        return dtype.itemsize
    return _DTYPE_BYTES[dtype_name(dtype)]


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """Maps a `--dtype` value ('bfloat16', 'float32', 'float16', their aliases) to a torch
    dtype (imports torch). 'auto' is resolved by the caller. Raises ValueError on an unknown
    name."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, dtype_name(name))


@dataclass(frozen=True)
class ModelConfig:
    """The model's architecture (Llama family) and the serving length limit.

    max_model_len: the longest sequence (prompt + output) served, in tokens.
    dtype: the weights' and KV cache's dtype. The engine passes a torch dtype (EngineArgs
        resolves --dtype); torch-free callers (the tuner's feasibility check) pass its name,
        read through `dtype_name` / `element_bytes`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    dtype: torch.dtype | str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.max_model_len <= 0:
            object.__setattr__(self, "max_model_len", self.max_position_embeddings)
        if self.max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's context length "
                f"({self.max_position_embeddings}); lower {settings.BY_NAME['max_model_len'].flag}"
            )

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """Bytes of KV cache one token takes over all layers:
        2 (K and V) x num_layers x num_kv_heads x head_dim x bytes per element."""
        if dtype_bytes is None:
            dtype_bytes = element_bytes(self.dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    block_size: tokens per KV block.
    gpu_memory_utilization: fraction (0, 1] of device memory the engine may use; the KV
        cache gets what is left after the weights and the profiled peak activation. On CPU,
        device memory is the machine's or the cgroup's memory.
    swap_space: GiB of host memory for blocks of swapped-out requests.
    num_gpu_blocks_override: use exactly this many blocks (testing, as in vLLM).
    kv_cache_memory_bytes: each rank's KV cache holds exactly this many bytes (rounded down to
        whole blocks) instead of what gpu_memory_utilization leaves; the CPU space cap does not
        apply either (vLLM: "kv_cache_memory_bytes (when not-None) ignores gpu_memory_utilization").
    cpu_kvcache_space_bytes: on CPU, each rank's KV cache holds at most this many bytes
        (vLLM's VLLM_CPU_KVCACHE_SPACE; EngineArgs reads it, 4 GiB when unset); None: no cap.
    """

    block_size: int = _default("block_size")
    gpu_memory_utilization: float = _default("gpu_memory_utilization")
    swap_space: float = _default("swap_space")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    num_gpu_blocks_override: int | None = None
    cpu_kvcache_space_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.cpu_kvcache_space_bytes is not None and self.cpu_kvcache_space_bytes <= 0:
            raise ValueError(f"cpu_kvcache_space_bytes must be > 0, got {self.cpu_kvcache_space_bytes}")
        settings.check({name: getattr(self, name) for name in (
            "block_size", "gpu_memory_utilization", "swap_space", "num_gpu_blocks_override",
            "kv_cache_memory_bytes")})


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    max_num_batched_tokens: the per-step token budget.
    max_num_seqs: at most this many requests run at once.
    enable_chunked_prefill: decodes first, then prefills fill the budget, the last one
        chunked to fit. Off: a step is prefills or decodes, prefills first, so a prompt
        longer than the budget could never run.
    preemption_mode: 'recompute' (drop blocks, re-prefill later) or 'swap' (copy blocks to
        host swap space and back).
    """

    max_model_len: int
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = settings.DEFAULT_MAX_NUM_SEQS
    enable_chunked_prefill: bool = _default("enable_chunked_prefill")
    preemption_mode: str = _default("preemption_mode")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            default = default_max_num_batched_tokens(self.enable_chunked_prefill, self.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", default)
        settings.check({name: getattr(self, name) for name in (
            "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "preemption_mode", "max_model_len")})


def _divisors_text(n: int) -> str:
    """'1, 2 or 4' for 4: the node counts a world of n ranks can be spread over."""
    divisors = [str(d) for d in range(1, n + 1) if settings.nnodes_divides(n, d)]
    return divisors[0] if len(divisors) == 1 else ", ".join(divisors[:-1]) + " or " + divisors[-1]


def node_ranks(world_size: int, nnodes: int, node_rank: int) -> range:
    """The global ranks node (pod) `node_rank` of `nnodes` runs: world_size / nnodes
    contiguous ranks, [node_rank x k, (node_rank + 1) x k). E.g. tp=2, pp=2 over 2 nodes:
    node 0 runs ranks 0-1 (stage 0), node 1 ranks 2-3 (stage 1), so pipeline stages, not
    tensor-parallel groups, cross nodes when tp divides k. Raises ValueError when nnodes does
    not divide world_size or node_rank is out of range. Source: vLLM's multi-node
    executor (global rank = node_rank x local world size + local rank)."""
    if not settings.nnodes_divides(world_size, nnodes):
        raise ValueError(f"nnodes {nnodes} must divide tensor_parallel_size x pipeline_parallel_size = "
                         f"{world_size} (each node runs the same number of ranks)")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} is not in [0, {nnodes})")
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallel sizes (world size = tp x pp), and the nodes the ranks run
    on. Pipeline stages get contiguous layer ranges split as vLLM's get_pp_indices does
    (engine/distributed/parallel_layout.py), so pipeline_parallel_size need not divide the layers.

    nnodes / node_rank / master_addr / master_port: vLLM's multi-node settings
    (`vllm serve --nnodes --node-rank --master-addr --master-port`): node r runs the
    world / nnodes contiguous global ranks from r x (world / nnodes); every node meets the
    others at node 0's master_addr:master_port (engine/distributed/rendezvous.py). Raises ValueError
    when nnodes does not divide the world or node_rank is not below nnodes."""

    tensor_parallel_size: int = _default("tensor_parallel_size")
    pipeline_parallel_size: int = _default("pipeline_parallel_size")
    nnodes: int = _default("nnodes")
    node_rank: int = _default("node_rank")
    master_addr: str = _default("master_addr")
    master_port: int = _default("master_port")

    def __post_init__(self) -> None:
        settings.check({name: getattr(self, name) for name in (
            "tensor_parallel_size", "pipeline_parallel_size", "nnodes", "node_rank", "master_addr", "master_port")})
        if not settings.nnodes_divides(self.world_size, self.nnodes):
            raise ValueError(
                f"nnodes {self.nnodes} must divide tensor_parallel_size x pipeline_parallel_size = "
                f"{self.tensor_parallel_size} x {self.pipeline_parallel_size} = {self.world_size} (every node runs "
                f"as many ranks); use --nnodes {_divisors_text(self.world_size)}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be in [0, nnodes) = [0, {self.nnodes}); "
                             f"number the nodes 0 to {self.nnodes - 1}")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks each node runs: world_size / nnodes."""
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that runs global rank `rank`."""
        return rank // self.ranks_per_node

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs: [node_rank x k, (node_rank + 1) x k), k = ranks_per_node."""
        return node_ranks(self.world_size, self.nnodes, self.node_rank)

    def local_rank(self, rank: int) -> int:
        """Global rank `rank`'s index on its node (its CUDA device; its share of the CPU threads)."""
        return rank % self.ranks_per_node

    def check_model(self, model: ModelConfig) -> None:
        """Raises ValueError when tensor_parallel_size does not divide the model's heads,
        KV heads or MLP width, or pipeline_parallel_size exceeds its layers."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if model.num_heads % tp or model.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the model's {model.num_heads} attention "
                f"heads and {model.num_kv_heads} KV heads"
            )
        if model.intermediate_size % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the model's MLP width (intermediate_size "
                f"{model.intermediate_size})"
            )
        if pp > model.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {pp} exceeds the model's {model.num_layers} layers"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved. Built by `EngineArgs.create_engine_config`."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    served_model_name: str = ""
    seed: int = _default("seed")
    attention_backend: str = "torch"
    device: str = "cpu"
    quantization: str | None = None  # 'gguf': quantized_weights_path is the GGUF file
    quantized_weights_path: str | None = None
    # --max-model-len auto: the engine lowers max_model_len to what the KV cache holds once sized
    auto_max_model_len: bool = False
    performance_mode: str = _default("performance_mode")
