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

from kvpilot.engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from kvpilot.engine.cpu_info import choose_auto_dtype
from kvpilot.engine.entrypoints.cli_args import DEFAULT_MODEL, add_engine_args
from kvpilot.engine.memory import cpu_kvcache_space_bytes

logger = logging.getLogger("kvpilot.engine")


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int = 16
    swap_space: float = 4.0
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = False
    num_gpu_blocks_override: int | None = None
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str | None = None
    device: str | None = None

    def resolved_device(self) -> str:
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_engine_config(self) -> EngineConfig:
        """Raises ValueError for invalid values or an unknown model."""
        from kvpilot.engine.attention import BACKENDS, default_backend
        from kvpilot.engine.model_loader import load_model_config, resolve_model_path

        device = self.resolved_device()
        backend = self.attention_backend or default_backend(device)
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
        if self.dtype == "auto":
            choice = choose_auto_dtype(device)
            dtype = choice.dtype
            logger.info("dtype auto -> %s: %s", str(dtype).removeprefix("torch."), choice.reason)
        else:
            dtype = resolve_dtype(self.dtype)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        path = resolve_model_path(self.model)
        model = load_model_config(path, self.max_model_len, dtype)
        parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)
        parallel.check_model(model)
        cache = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cpu_kvcache_space_bytes=cpu_kvcache_space_bytes(os.environ) if device == "cpu" else None,
        )
        scheduler = SchedulerConfig(
            max_model_len=model.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
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
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """Adds vLLM's engine flags (--max-num-seqs, --enable-chunked-prefill, ...); the parser
        is built in the torch-free `entrypoints.cli_args` so the operator can use it too."""
        add_engine_args(parser, positional_model)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
