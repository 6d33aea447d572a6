"""Engine arguments with `vllm serve`'s flag names, shared by the offline `LLM` API, the
server and the benchmarks. `EngineArgs.add_cli_args` adds the flags to an argparse parser;
`create_engine_config` resolves the model and validates everything (ValueError saying what
to change). Source: vLLM `vllm/engine/arg_utils.py`.

Importing this module loads no torch (the tuner reads EngineArgs' defaults); torch, the
attention backends and the model loader load in `create_engine_config`."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, fields

from kvpilot.engine import settings
from kvpilot.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from kvpilot.engine.cpu.info import choose_auto_dtype
from kvpilot.engine.memory import cpu_kvcache_space_bytes
from kvpilot.engine.settings.cli_args import DEFAULT_MODEL, add_engine_args

logger = logging.getLogger("kvpilot.engine")


def _default(name: str):
    return settings.BY_NAME[name].default


def check_parallel(parallel: ParallelConfig, model: ModelConfig, device: str) -> None:
    """Raises ValueError when the layout does not fit the model (ParallelConfig.check_model)
    or, on CUDA, when a node runs more ranks than it sees GPUs (one GPU per rank, its local rank)."""
    parallel.check_model(model)
    if device.startswith("cuda"):
        import torch

        visible = torch.cuda.device_count()
        if parallel.ranks_per_node > visible:
            raise ValueError(
                f"each node runs tensor_parallel_size x pipeline_parallel_size / nnodes = {parallel.ranks_per_node} "
                f"ranks, one GPU each, but this node sees {visible} GPU(s): raise --nnodes or lower the parallel sizes")


@dataclass
class EngineArgs:
    """The engine's settings by vLLM's names; defaults, bounds and rules are those of
    `kvpilot.engine.settings` (tests/engine/test_settings.py checks every field is there)."""

    model: str = DEFAULT_MODEL
    served_model_name: str | None = _default("served_model_name")
    max_model_len: int | None = _default("max_model_len")
    max_num_seqs: int | None = _default("max_num_seqs")
    max_num_batched_tokens: int | None = _default("max_num_batched_tokens")
    performance_mode: str = _default("performance_mode")
    gpu_memory_utilization: float = _default("gpu_memory_utilization")
    kv_cache_memory_bytes: int | None = _default("kv_cache_memory_bytes")
    enable_chunked_prefill: bool = _default("enable_chunked_prefill")
    tensor_parallel_size: int = _default("tensor_parallel_size")
    pipeline_parallel_size: int = _default("pipeline_parallel_size")
    nnodes: int = _default("nnodes")
    node_rank: int = _default("node_rank")
    master_addr: str = _default("master_addr")
    master_port: int = _default("master_port")
    block_size: int = _default("block_size")
    swap_space: float = _default("swap_space")
    preemption_mode: str = _default("preemption_mode")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    num_gpu_blocks_override: int | None = _default("num_gpu_blocks_override")
    dtype: str = _default("dtype")
    seed: int = _default("seed")
    attention_backend: str | None = _default("attention_backend")
    device: str | None = _default("device")
    quantization: str | None = _default("quantization")

    def resolved_device(self) -> str:
        """The torch device to run on: `device` when set, else 'cuda' when torch sees a GPU, else 'cpu'."""
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_engine_config(self) -> EngineConfig:
        """Raises ValueError for invalid values or an unknown model."""
        settings.check({f.name: getattr(self, f.name) for f in fields(self) if f.name in settings.BY_NAME})
        from kvpilot.engine.attention import default_backend
        from kvpilot.engine.model_loader import gguf_file, gguf_source, load_model_config, resolve_model_path

        device = self.resolved_device()
        backend = self.attention_backend or default_backend(device)
        if self.dtype == "auto":
            choice = choose_auto_dtype(device)
            dtype = choice.dtype
            logger.info("dtype auto -> %s: %s", str(dtype).removeprefix("torch."), choice.reason)
        else:
            dtype = resolve_dtype(self.dtype)
        quantization = settings.resolve_quantization(self.quantization, gguf_source(self.model) is not None,
                                                     device == "cpu")
        if quantization == "gguf" and device == "cpu":  # a bad KVPILOT_GGUF_ACTIVATIONS fails here, before any load
            from kvpilot.engine.cpu import kernel_path as cpu_kernel_path

            cpu_kernel_path.current()
        if self.performance_mode == "interactivity":
            logger.info("performance_mode interactivity: vLLM picks fine-grained CUDA graphs for it; kvpilot's "
                        "engine has none and runs as balanced")
        path = resolve_model_path(self.model)
        auto_len = self.max_model_len == settings.AUTO_MAX_MODEL_LEN  # sized down once the KV cache is
        model = load_model_config(path, None if auto_len else self.max_model_len, dtype)
        parallel = ParallelConfig(**{f.name: getattr(self, f.name) for f in fields(ParallelConfig)})
        check_parallel(parallel, model, device)
        cache = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cpu_kvcache_space_bytes=cpu_kvcache_space_bytes(os.environ) if device == "cpu" else None,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        )
        scheduler = SchedulerConfig(
            max_model_len=model.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens or settings.default_max_num_batched_tokens(
                self.enable_chunked_prefill, model.max_model_len, self.performance_mode),
            max_num_seqs=self.max_num_seqs or settings.default_max_num_seqs(self.performance_mode),
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
        )
        return EngineConfig(
            model_path=str(path),
            model=model,
            cache=cache,
            scheduler=scheduler,
            parallel=parallel,
            served_model_name=self.served_model_name or self.model.removeprefix("builtin://"),
            seed=self.seed,
            attention_backend=backend,
            device=device,
            quantization=quantization,
            quantized_weights_path=str(gguf_file(self.model)) if quantization == "gguf" else None,
            auto_max_model_len=auto_len,
            performance_mode=self.performance_mode,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """Adds vLLM's engine flags (those of `kvpilot.engine.settings`); the parser
        is built in the torch-free `kvpilot.engine.settings.cli_args` so the operator can use it too."""
        add_engine_args(parser, positional_model)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """EngineArgs from a namespace parsed by `add_cli_args`'s parser; fields the namespace
        lacks keep their defaults."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
