"""The engine settings one trial runs with, and their three spellings: `vllm serve` flags,
the InferenceService's `spec.engine` (camelCase) and the study's parameters.

Which settings can change on a running engine: the scheduler limits
(`max_num_seqs`, `max_num_batched_tokens`, `enable_chunked_prefill`, `preemption_mode`),
through the server's `POST /admin/scheduler_config` (kvpilot's engine:
`LLMEngine.update_scheduler_config`). Everything else sizes memory or processes at startup
and needs a restart (locally) or a rollout (in a cluster).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.config import default_max_num_batched_tokens

LIVE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "preemption_mode")

# snake_case field -> InferenceService spec.engine key (crds/inferenceservices.kvpilot.dev.yaml)
SPEC_KEYS = {
    "max_model_len": "maxModelLen",
    "max_num_seqs": "maxNumSeqs",
    "max_num_batched_tokens": "maxNumBatchedTokens",
    "gpu_memory_utilization": "gpuMemoryUtilization",
    "enable_chunked_prefill": "enableChunkedPrefill",
    "tensor_parallel_size": "tensorParallelSize",
    "pipeline_parallel_size": "pipelineParallelSize",
    "block_size": "blockSize",
    "enable_prefix_caching": "enablePrefixCaching",
    "preemption_mode": "preemptionMode",
    "swap_space": "swapSpace",
}


@dataclass(frozen=True)
class EngineSettings:
    """One point of the search: the engine flags a trial runs with.

    Defaults are the engine's own (`kvpilot.engine.arg_utils.EngineArgs`, which keeps
    vLLM's), with `max_num_batched_tokens` resolved as `SchedulerConfig` does: 2048 with
    chunked prefill, max(max_model_len, 2048) without. Units: lengths and budgets in
    tokens, gpu_memory_utilization a fraction of device memory, swap_space in GiB.
    """

    max_model_len: int = 2048
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    tensor_parallel_size: int = EngineArgs.tensor_parallel_size
    pipeline_parallel_size: int = EngineArgs.pipeline_parallel_size
    block_size: int = EngineArgs.block_size
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    preemption_mode: str = EngineArgs.preemption_mode
    swap_space: float = EngineArgs.swap_space

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            default = default_max_num_batched_tokens(self.enable_chunked_prefill, self.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", default)
        object.__setattr__(self, "gpu_memory_utilization", round(float(self.gpu_memory_utilization), 3))

    def replace(self, **changes: Any) -> EngineSettings:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_flags(self) -> list[str]:
        """`vllm serve` / `kvpilot serve` flags for these settings (without the model)."""
        flags = [
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--gpu-memory-utilization", repr(self.gpu_memory_utilization),
            "--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill",
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--pipeline-parallel-size", str(self.pipeline_parallel_size),
            "--block-size", str(self.block_size),
            "--preemption-mode", self.preemption_mode,
            "--swap-space", repr(float(self.swap_space)),
        ]
        if self.enable_prefix_caching:
            flags.append("--enable-prefix-caching")
        return flags

    def to_engine_spec(self) -> dict[str, Any]:
        """The InferenceService `spec.engine` keys these settings set (camelCase)."""
        return {SPEC_KEYS[k]: v for k, v in self.as_dict().items()}

    @classmethod
    def from_engine_spec(cls, engine: Mapping[str, Any]) -> EngineSettings:
        """Reads a `spec.engine` mapping; keys it lacks take the engine defaults."""
        values = {k: engine[camel] for k, camel in SPEC_KEYS.items() if camel in engine}
        return cls(**values)

    def live_changes(self, new: EngineSettings) -> dict[str, Any] | None:
        """The scheduler changes that turn a running `self` into `new` without a restart
        (possibly {}), or None when `new` differs in a setting that needs a restart."""
        changes = {}
        for f in dataclasses.fields(self):
            old_value, new_value = getattr(self, f.name), getattr(new, f.name)
            if old_value == new_value:
                continue
            if f.name not in LIVE_FIELDS:
                return None
            changes[f.name] = new_value
        return changes

    def describe(self) -> str:
        """Short human form, e.g. 'mnbt=2048 seqs=256 gmu=0.9 chunked tp1pp1'."""
        text = (f"mnbt={self.max_num_batched_tokens} seqs={self.max_num_seqs} "
                f"gmu={self.gpu_memory_utilization:g} {'chunked' if self.enable_chunked_prefill else 'no-chunk'} "
                f"tp{self.tensor_parallel_size}pp{self.pipeline_parallel_size}")
        if self.block_size != 16:
            text += f" bs={self.block_size}"
        if self.enable_prefix_caching:
            text += " prefix-cache"
        return text
