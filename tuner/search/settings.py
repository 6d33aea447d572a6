"""The engine settings one trial runs with, and their three spellings: `vllm serve` flags,
the InferenceService's `spec.engine` (camelCase) and the study's parameters. The one
setting of the layout that is not an engine flag of a single process, `nnodes` (the pods
one engine spans, vLLM's `--nnodes`), lives in the InferenceService's
`spec.parallelism.nnodes` (`to_spec`).

All three come from `kvpilot.engine.settings`, which also says which settings can change on a
running engine (`live`: the scheduler limits, through the server's `POST
/admin/scheduler_config`). Everything else sizes memory or processes at startup and needs a
restart (locally) or a rollout (in a cluster).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.api.spec import default_block_size
from kvpilot.engine import settings
from kvpilot.engine.settings import (AUTO_MAX_MODEL_LEN, LIVE_SETTINGS, default_max_num_batched_tokens,
                                     default_max_num_seqs)

LIVE_FIELDS = LIVE_SETTINGS  # changeable on a running engine (POST /admin/scheduler_config)
_DEFAULTS = settings.deploy_defaults()


@dataclass(frozen=True)
class EngineSettings:
    """One point of the search: the engine flags a trial runs with.

    Defaults are `kvpilot.engine.settings.deploy_defaults()` (the engine's, vLLM's, with a
    fixed max_model_len of 2048 as the CRD has), with `max_num_seqs` and `max_num_batched_tokens`
    derived as the engine does: 256 sequences and a budget of 2048 with chunked prefill,
    max(max_model_len, 2048) without, both doubled in performance_mode 'throughput'.
    max_model_len -1 is vLLM's auto (the longest the KV cache holds). Units: lengths and
    budgets in tokens, gpu_memory_utilization a fraction of device memory, kv_cache_memory_bytes
    bytes per rank (None: sized from gpu_memory_utilization), swap_space in GiB. nnodes: pods
    (nodes, in vLLM's word) the tensor_parallel_size x pipeline_parallel_size ranks are spread
    over, world / nnodes each (spec.parallelism.nnodes; feasibility refuses one that does not
    divide the world). Raises ValueError for nnodes < 1.
    """

    max_model_len: int = _DEFAULTS["max_model_len"]
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = _DEFAULTS["gpu_memory_utilization"]
    enable_chunked_prefill: bool = _DEFAULTS["enable_chunked_prefill"]
    tensor_parallel_size: int = _DEFAULTS["tensor_parallel_size"]
    pipeline_parallel_size: int = _DEFAULTS["pipeline_parallel_size"]
    block_size: int = _DEFAULTS["block_size"]
    enable_prefix_caching: bool = _DEFAULTS["enable_prefix_caching"]
    preemption_mode: str = _DEFAULTS["preemption_mode"]
    swap_space: float = _DEFAULTS["swap_space"]
    performance_mode: str | None = _DEFAULTS["performance_mode"]  # None: the engine's (balanced), no flag
    kv_cache_memory_bytes: int | None = _DEFAULTS["kv_cache_memory_bytes"]
    nnodes: int = 1

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes (pods one engine spans) must be >= 1, got {self.nnodes}")
        if self.max_num_seqs is None:
            object.__setattr__(self, "max_num_seqs", default_max_num_seqs(self.performance_mode))
        if self.max_num_batched_tokens is None:
            auto = self.max_model_len == AUTO_MAX_MODEL_LEN  # not known before the cache is sized: no floor
            default = default_max_num_batched_tokens(self.enable_chunked_prefill or auto, self.max_model_len,
                                                     self.performance_mode)
            object.__setattr__(self, "max_num_batched_tokens", default)
        object.__setattr__(self, "gpu_memory_utilization", round(float(self.gpu_memory_utilization), 3))

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with `changes` applied (dataclasses.replace: __post_init__ checks them again, ValueError)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """{setting: value}, as trial user attributes keep it (EngineSettings(**d) reads it back)."""
        return dataclasses.asdict(self)

    def to_flags(self, runtime: str = "kvpilot") -> list[str]:
        """`kvpilot serve` (runtime "kvpilot") or `vllm serve` (runtime "vllm": the pinned vLLM,
        without the flags it no longer takes, settings.NOT_IN_VLLM) flags for these settings,
        without the model; nnodes only above 1 (one node is vLLM's default, and servers before
        --nnodes lack the flag). ValueError: an unknown runtime."""
        values = self.as_dict()
        if values["nnodes"] == 1:
            del values["nnodes"]
        return settings.to_flags(values, runtime=runtime)

    def to_engine_spec(self) -> dict[str, Any]:
        """The InferenceService `spec.engine` keys these settings set (camelCase); unset ones
        (None: performanceMode, kvCacheMemoryBytes) are left out, as the CRD has no null."""
        return {camel: getattr(self, k) for k, camel in SPEC_KEYS.items() if getattr(self, k) is not None}

    def to_spec(self) -> dict[str, Any]:
        """The InferenceService `spec` keys a trial sets: `engine` (`to_engine_spec`) and
        `parallelism.nnodes`, in one mapping so that one merge patch changes both (one
        generation, one rollout)."""
        return {"engine": self.to_engine_spec(), "parallelism": {"nnodes": self.nnodes}}

    @classmethod
    def from_engine_spec(cls, engine: Mapping[str, Any]) -> EngineSettings:
        """Reads a `spec.engine` mapping; keys it lacks take the engine defaults."""
        values = {k: engine[camel] for k, camel in SPEC_KEYS.items() if camel in engine}
        return cls(**values)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> EngineSettings:
        """Reads an InferenceService `spec`: `engine` as `from_engine_spec`, but an absent
        blockSize is the operator's (`kvpilot.api.spec.default_block_size`: 128 for runtime vllm
        on CPUs), and nnodes from `parallelism.nnodes` (absent: 1, the CRD's default)."""
        engine = dict(spec.get("engine") or {})
        if engine.get("blockSize") is None:
            engine["blockSize"] = default_block_size(engine.get("runtime", "kvpilot"),
                                                     bool((spec.get("resources") or {}).get("gpu")))
        nnodes = int((spec.get("parallelism") or {}).get("nnodes") or 1)
        return cls.from_engine_spec(engine).replace(nnodes=nnodes)

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
        if self.kv_cache_memory_bytes is not None:
            text += f" kv={self.kv_cache_memory_bytes / (1 << 20):.1f}MiB"
        if self.performance_mode not in (None, "balanced"):
            text += f" {self.performance_mode}"
        if self.max_model_len == AUTO_MAX_MODEL_LEN:
            text += " len=auto"
        if self.nnodes > 1:
            text += f" nnodes={self.nnodes}"
        return text


# the layout's pod count: spec.parallelism.nnodes, not a key of spec.engine (`to_spec`)
PARALLELISM_FIELDS = ("nnodes",)
# snake_case field -> InferenceService spec.engine key, for the settings a trial sets
SPEC_KEYS = {f.name: settings.CRD_FIELDS[f.name] for f in dataclasses.fields(EngineSettings)
             if f.name not in PARALLELISM_FIELDS}
