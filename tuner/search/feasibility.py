"""Feasibility before cost: decides, without starting anything, whether the engine would
accept a setting and fit one `max_model_len` sequence in its KV cache.

The rules are the engine's own: `SchedulerConfig`, `CacheConfig` and `ParallelConfig` raise
ValueError for invariant breaks (budget >= max_num_seqs, budget >= max_model_len without
chunked prefill, parallel sizes that do not divide the heads), and the KV-cache arithmetic is
`kvpilot.engine.memory` (`KVCachePlan`, `check_fits`) over the per-rank shares of
`kvpilot.engine.distributed.parallel_layout` (the engine's own layer split and rank layout):

    rank r holds: its stage's layers' weights / tp (+ embedding shard on the first stage,
                  LM head shard on the last), a peak activation, and per block
                  block_size x 2 x its stage's layers x kv_heads / tp x head_dim x bytes
    one device per rank: KV blocks = min over r of
                  (device memory x gpu_memory_utilization - weights_r - activation_r) // block_bytes_r
    kv_cache_memory_bytes set: KV blocks = kv_cache_memory_bytes // the largest block_bytes_r
                  (memory fraction and CPU space not used, as in the engine and vLLM)
    max_model_len -1 (auto): min(the model's context, KV blocks x block_size)
    shared memory (CPU, all ranks in one machine or pod): KV blocks =
                  (memory x gpu_memory_utilization - sum weights_r - sum activation_r) // sum block_bytes_r
                  and at most min over r of cpu_kvcache_space // block_bytes_r (VLLM_CPU_KVCACHE_SPACE
                  GiB per rank, 4 GiB when unset, as the engine reads it)
    over nnodes pods (spec.parallelism.nnodes, vLLM's --nnodes): nnodes must divide tp x pp;
                  each pod runs world / nnodes contiguous ranks (`engine.config.node_ranks`)
                  under its own resources (resources are per pod): at most num_devices ranks
                  and, on CPU, at most ceil(cpus) ranks per pod; on CPU the sums above run
                  over one pod's ranks and the pod with the fewest blocks decides
    dtype on CPU: `--dtype auto` is the engine's rule of `kvpilot.engine.cpu.info` (bfloat16 with
                  native bf16, float32 otherwise), so the weights and KV bytes follow it

The engine measures the peak activation by profiling a step; the tuner can only estimate it
(`estimate_activation_bytes`), so a setting near the edge may still fail at startup: the
runner then classifies it as out of memory (see `kvpilot.tuner.failures`).
Source: vLLM `Worker.determine_available_memory` and its performance-tuning guide.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpilot.engine.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, dtype_name,
                                   element_bytes)
from kvpilot.engine.cpu.info import choose_cpu_dtype, detect_cpu, has_bf16_matmul_kernel
from kvpilot.engine.memory import (  # noqa: F401 (estimate_activation_bytes: re-exported)
    KVCachePlan,
    RankMemory,
    check_fits,
    cpu_kvcache_space_bytes,
    estimate_activation_bytes,
)
from kvpilot.engine.settings import AUTO_MAX_MODEL_LEN, BY_NAME, nnodes_divides
from kvpilot.engine.distributed.parallel_layout import (
    RankPosition,
    rank_gguf_block_bytes,
    rank_kv_bytes_per_token,
    rank_num_params,
    rank_vocab_params,
)
from kvpilot.api.models import BUILTIN_MODELS, BUILTIN_SCHEME, ModelShape
from kvpilot.tuner.search.settings import EngineSettings

if TYPE_CHECKING:  # dtypes travel as names ('bfloat16'): the tuner runs without torch
    import torch


def model_config_from_shape(shape: ModelShape, dtype: str | torch.dtype = "bfloat16") -> ModelConfig:
    """An engine `ModelConfig` for a builtin shape. The shape table has no MLP width, so
    intermediate_size is derived from the parameter count (exact for Llama-family models)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    embed = shape.vocab_size * h
    per_layer_rest = h * (q + 2 * kv) + q * h + 2 * h
    mlp = (shape.num_params - embed - h) / shape.num_layers - per_layer_rest
    return ModelConfig(
        vocab_size=shape.vocab_size, hidden_size=h, intermediate_size=max(1, round(mlp / (3 * h))),
        num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True, dtype=dtype,
    )


def resolve_model(model: str, dtype: str | torch.dtype = "bfloat16") -> ModelConfig:
    """The shape of `model`: a builtin name (`smollm2-135m-instruct` or `builtin://...`,
    from `kvpilot.api.models`) or a Hugging Face directory with config.json (read by
    `kvpilot.engine.model_loader.load_model_config`). Raises ValueError otherwise."""
    name = model.removeprefix(BUILTIN_SCHEME)
    if name in BUILTIN_MODELS:
        return model_config_from_shape(BUILTIN_MODELS[name], dtype)
    path = Path(model)
    if (path / "config.json").is_file():
        from kvpilot.engine.model_loader import load_model_config

        return load_model_config(path, None, dtype)
    raise ValueError(f"unknown model {model!r}: use a builtin name ({', '.join(BUILTIN_MODELS)}) or a HF directory")


def model_directory(model: str) -> Path:
    """The Hugging Face directory (absolute) that upstream vLLM serves for `model`:
    `kvpilot.engine.model_loader.resolve_model_path`'s (a builtin name or a .gguf file is its
    safetensors conversion under the kvpilot cache, made once; a directory is itself). Raises
    ValueError for anything else."""
    from kvpilot.engine.model_loader import resolve_model_path  # torch: only where vLLM runs

    return Path(resolve_model_path(model)).resolve()


@dataclass(frozen=True)
class Hardware:
    """What the engine will run on.

    device_memory_bytes: memory of one device (GPU), or of one pod or machine (CPU: its RAM
        or cgroup limit, spec.resources.memory).
    num_devices: devices of one pod or machine: bounds the ranks each pod runs (tp x pp /
        nnodes; with nnodes 1, tp x pp).
    shared_memory: the ranks of one pod draw on the same device_memory_bytes (a CPU engine:
        its ranks are processes in one machine or pod), instead of one device each.
    cpus: CPUs of one pod (spec.resources.cpu); None: not checked. A CPU engine's pod needs
        one per rank it runs (the engine gives every rank at least one thread,
        engine/cpu/threads.py, and rounds a fractional quota up).
    one_machine: every node of a multi-node layout runs on this one machine (`kvpilot tune
        --local` starts them as processes), so its memory, devices and CPUs serve all ranks
        whatever nnodes is.
    num_gpu_blocks_override: when the engine is started with --num-gpu-blocks-override,
        the KV cache has exactly this many blocks whatever the memory.
    activation_scale: multiplies `estimate_activation_bytes` (calibrate against the
        engine's startup log "peak activation").

    dtype: the engine's dtype, a name ('bfloat16') or a torch dtype. None: on CPU
        (shared_memory) what `--dtype auto` picks on this machine's CPU
        (kvpilot.engine.cpu.info), on GPUs the model's dtype.
    cpu_kvcache_space_bytes: on CPU, each rank's KV cache cap; None: the engine's rule
        (VLLM_CPU_KVCACHE_SPACE of this environment, 4 GiB when unset).

    A CPU engine (shared_memory) in bfloat16 also keeps a oneDNN-packed copy of its linear
    and LM-head weights (engine/layers/linear.py), so its weights count twice (where this
    machine's CPU has AVX512_BF16, kernels/cpu/bf16_gemm.py's copy replaces the plain linear weights
    and adds a third copy of the embedding / LM head); in float32 the packed copies replace the
    plain ones, and only the embedding / LM-head weights count twice.
    """

    device_memory_bytes: int
    num_devices: int = 1
    num_gpu_blocks_override: int | None = None
    activation_scale: float = 1.0
    shared_memory: bool = False
    dtype: str | torch.dtype | None = None
    cpu_kvcache_space_bytes: int | None = None
    quantization: str | None = None  # settings.resolve_quantization of the engine; gguf on CPU adds the blocks
    cpus: float | None = None
    one_machine: bool = False

    def engine_dtype(self, model: ModelConfig) -> str:
        """The name of the dtype the engine runs in ('bfloat16', 'float32', 'float16')."""
        if self.dtype is not None:
            return dtype_name(self.dtype)
        return choose_cpu_dtype(detect_cpu()).name if self.shared_memory else dtype_name(model.dtype)

    def kv_space_bytes(self) -> int | None:
        """The per-rank KV cap on CPU (None on GPUs)."""
        if not self.shared_memory:
            return None
        if self.cpu_kvcache_space_bytes is not None:
            return self.cpu_kvcache_space_bytes
        return cpu_kvcache_space_bytes(dict(os.environ))


def estimate_rank_memory(settings: EngineSettings, model: ModelConfig, parallel: ParallelConfig,
                         activation_scale: float = 1.0, packed_weights: bool = False,
                         gguf_blocks: bool = False, packed_vocab: bool = False) -> list[RankMemory]:
    """Every rank's predicted weights, activation and KV bytes per block, in rank order,
    from the engine's layer split (`parallel_layout`). packed_weights: the engine holds a
    second, oneDNN-packed copy of its weights (CPU, bfloat16). gguf_blocks: it also holds
    the GGUF's blocks (`--quantization gguf`, CPU, float32 or bfloat16). packed_vocab: each embedding
    and LM-head weight is held twice, plain and packed (CPU, float32: the linear layers'
    packed copies replace their plain weights, layers/linear.py)."""
    weight_elem = element_bytes(model.dtype) * (2 if packed_weights else 1)
    ranks = []
    for rank in range(parallel.world_size):
        pos = RankPosition.of(rank, parallel)
        activation = estimate_activation_bytes(model, settings.max_num_batched_tokens, settings.max_num_seqs,
                                               pos.tp_size, with_logits=pos.is_last_stage or rank == 0)
        weights = rank_num_params(model, parallel, rank) * weight_elem
        weights += rank_gguf_block_bytes(model, parallel, rank) if gguf_blocks else 0
        if packed_vocab:  # the embedding / LM-head weights keep their plain copy beside the packed one
            weights += rank_vocab_params(model, parallel, rank) * element_bytes(model.dtype)
        ranks.append(RankMemory(rank, weights,
                                int(activation * activation_scale),
                                settings.block_size * rank_kv_bytes_per_token(model, parallel, rank)))
    return ranks


@dataclass(frozen=True)
class Feasibility:
    """The verdict on one setting. reason is empty when feasible; num_blocks is the
    predicted KV-cache size in blocks (0 when a rule failed before sizing)."""

    feasible: bool
    reason: str = ""
    num_blocks: int = 0
    max_concurrency: float = 0.0


def pod_problem(world_size: int, nnodes: int, hardware: Hardware) -> str:
    """Why `world_size` ranks over `nnodes` pods do not fit the pods' resources ('' when
    they do): nnodes must divide the world, and each pod's world / nnodes ranks need a
    device each and, on CPU (shared_memory), a CPU each."""
    layout = f"tensor_parallel_size x pipeline_parallel_size = {world_size}"
    if not nnodes_divides(world_size, nnodes):
        return (f"layout: nnodes {nnodes} does not divide {layout} (each pod of the group runs world / nnodes "
                f"ranks); choose an nnodes that divides it")
    per_pod = world_size if hardware.one_machine else world_size // nnodes
    over = f" over {nnodes} pods is {per_pod} ranks per pod, which" if per_pod < world_size else ""
    if per_pod > hardware.num_devices:
        return f"{layout}{over} exceeds the {hardware.num_devices} available device(s) of a pod"
    if hardware.shared_memory and hardware.cpus is not None and per_pod > math.ceil(hardware.cpus):
        return f"{layout}{over} exceeds the pod's {hardware.cpus:g} CPU(s): a CPU engine runs each rank on a CPU"
    return ""


def check(settings: EngineSettings, model: ModelConfig, hardware: Hardware) -> Feasibility:
    """Applies the engine's rules and KV-cache arithmetic to `settings`; never raises for an
    infeasible setting, it returns the reason (the engine's own error message)."""
    auto = settings.max_model_len == AUTO_MAX_MODEL_LEN  # vLLM's auto: sized below, after the KV cache
    max_model_len = model.max_position_embeddings if auto else settings.max_model_len
    try:
        model = dataclasses.replace(model, max_model_len=max_model_len, dtype=hardware.engine_dtype(model))
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            preemption_mode=settings.preemption_mode,
        )
        CacheConfig(block_size=settings.block_size, gpu_memory_utilization=settings.gpu_memory_utilization,
                    swap_space=settings.swap_space, enable_prefix_caching=settings.enable_prefix_caching,
                    kv_cache_memory_bytes=settings.kv_cache_memory_bytes)
        parallel = ParallelConfig(settings.tensor_parallel_size, settings.pipeline_parallel_size)
        parallel.check_model(model)
    except ValueError as e:
        return Feasibility(False, f"engine rule: {e}")
    problem = pod_problem(parallel.world_size, settings.nnodes, hardware)
    if problem:
        return Feasibility(False, problem)
    packed = hardware.shared_memory and dtype_name(model.dtype) == "bfloat16"
    gguf = (hardware.quantization == "gguf" and hardware.shared_memory
            and dtype_name(model.dtype) in ("float32", "bfloat16"))
    vocab = hardware.shared_memory and (dtype_name(model.dtype) == "float32" or (
        packed and has_bf16_matmul_kernel(detect_cpu())))
    ranks = estimate_rank_memory(settings, model, parallel, hardware.activation_scale, packed, gguf, vocab)
    if hardware.num_gpu_blocks_override is not None:
        num_blocks, how = hardware.num_gpu_blocks_override, "num_gpu_blocks_override"
        block_bytes = sum(r.block_bytes for r in ranks)
    elif settings.kv_cache_memory_bytes is not None:  # per rank, as the engine reads it
        num_blocks = settings.kv_cache_memory_bytes // max(r.block_bytes for r in ranks)
        how, block_bytes = f"kv_cache_memory_bytes {settings.kv_cache_memory_bytes}", sum(r.block_bytes for r in ranks)
    else:
        plan = KVCachePlan.build(hardware.device_memory_bytes, settings.gpu_memory_utilization,
                                 settings.block_size, ranks, hardware.shared_memory, hardware.kv_space_bytes(),
                                 1 if hardware.one_machine else settings.nnodes)
        num_blocks, how = plan.num_blocks, "predicted: " + plan.describe()
        block_bytes = plan.budgets[plan.limiting].block_bytes
    if auto:  # the engine serves min(the model's context, what the cache holds)
        max_model_len = min(max_model_len, num_blocks * settings.block_size)
        if max_model_len < BY_NAME["max_model_len"].minimum:
            return Feasibility(False, f"KV cache: max_model_len auto: {num_blocks} blocks hold {max_model_len} "
                                      f"tokens, below the minimum of {BY_NAME['max_model_len'].minimum:g}", num_blocks)
    try:
        check_fits(num_blocks, settings.block_size, max_model_len, block_bytes, how)
    except ValueError as e:
        return Feasibility(False, f"KV cache: {e}", num_blocks)
    return Feasibility(True, "", num_blocks, num_blocks * settings.block_size / max_model_len)
