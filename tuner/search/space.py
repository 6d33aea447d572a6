"""The search space: which engine settings the tuner tries, and their bounds.

Per vLLM's performance-tuning guide, the knobs that decide latency and throughput are the
per-step token budget (`max_num_batched_tokens`: small favours inter-token latency, large
favours time to first token and throughput), the concurrency cap (`max_num_seqs`: too
high for the KV cache causes preemptions), the memory fraction
(`gpu_memory_utilization`: more KV cache, fewer preemptions), chunked prefill, and the
parallel sizes. The budget takes powers of two (the scale the guide's and the chunked
prefill study's sweeps use) plus `max_model_len`, the smallest budget chunked prefill
off accepts; `max_num_seqs` is log-uniform. Parallel sizes are limited to those whose
product fits the devices and that divide the model's heads (and, for even stages, layers).
Layouts that span pods (nnodes, vLLM's `--nnodes`, the InferenceService's
`spec.parallelism.nnodes`) enter only when the user gives a range of pods (`nnodes`, `kvpilot
tune --nnodes LOW:HIGH`): each layout is then tp x pp over an nnodes that divides it, with
at most `num_devices` ranks per pod.

Default ranges come from one table, `kvpilot.engine.settings.SEARCH_RANGES` (each setting's
`search`): `SearchSpace()`, `kvpilot tune`'s flags, the in-cluster tuner (which parses the
same flags) and the user guide's table (`ranges_markdown`) read it, and
tests/tuner/test_tuner_search_ranges.py fails when any of them differs.

Two of vLLM's newer knobs are opt-in axes: `kv_cache_memory_bytes` (a KV budget in bytes;
more bytes, fewer preemptions, like gpu_memory_utilization, which it overrides) and
`performance_mode`. On kvpilot's engine the mode only doubles the default limits, which
every trial sets explicitly, so it is not searched by default; on an upstream vLLM image
(`runtime: vllm`) it also picks CUDA graph sizes and kernels, which is where searching it
pays.

Suggest calls follow Optuna's define-by-run API (`suggest_int(..., log=True)`,
`suggest_categorical`); every setting not searched keeps the base (defaults) value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optuna

from kvpilot.engine.config import ModelConfig, ParallelConfig
from kvpilot.engine.settings import BY_NAME, SEARCH_RANGES, TUNED_SETTINGS, nnodes_divides
from kvpilot.tuner.search.settings import EngineSettings


@dataclass(frozen=True)
class SearchSpace:
    """Bounds of the search; `None` or an empty tuple keeps that setting at its base value.

    max_num_batched_tokens: (low, high) tokens; the candidates are the powers of two in it.
    max_num_seqs: (low, high) requests, sampled log-uniformly, or among the powers of two
        in it (and the base value) with max_num_seqs_pow2.
    gpu_memory_utilization: (low, high) fraction of device memory.
    enable_chunked_prefill: the values to try.
    parallel: search tp x pp over what `num_devices` (per pod) allows.
    nnodes: (low, high) pods one engine may span, searched with the layout; None keeps
        the base's (the resource's spec.parallelism.nnodes).
    block_size, enable_prefix_caching, performance_mode: optional values to try.
    kv_cache_memory_bytes: (low, high) bytes per rank, sampled log-uniformly (opt-in).
    Defaults: `kvpilot.engine.settings.SEARCH_RANGES`.
    """

    max_num_batched_tokens: tuple[int, int] | None = SEARCH_RANGES["max_num_batched_tokens"]
    max_num_seqs: tuple[int, int] | None = SEARCH_RANGES["max_num_seqs"]
    gpu_memory_utilization: tuple[float, float] | None = SEARCH_RANGES.get("gpu_memory_utilization")
    enable_chunked_prefill: tuple[bool, ...] = (True, False)
    parallel: bool = False
    num_devices: int = 1
    block_size: tuple[int, ...] = ()
    enable_prefix_caching: tuple[bool, ...] = ()
    max_num_seqs_pow2: bool = False
    kv_cache_memory_bytes: tuple[int, int] | None = SEARCH_RANGES.get("kv_cache_memory_bytes")
    performance_mode: tuple[str, ...] = ()
    nnodes: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.nnodes is not None and not 1 <= self.nnodes[0] <= self.nnodes[1]:
            raise ValueError(f"nnodes bounds must satisfy 1 <= low <= high pods, got {self.nnodes}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes"):
            bounds = getattr(self, name)
            if bounds is None:
                continue
            if not bounds[0] <= bounds[1]:
                raise ValueError(f"{name} bounds must satisfy low <= high, got {bounds}")
            problem = BY_NAME[name].problem(bounds[0]) or BY_NAME[name].problem(bounds[1])
            if problem:  # the engine's own bounds (kvpilot.engine.settings)
                raise ValueError(f"{name} bounds {bounds}: {problem}")
        for name in ("block_size", "enable_prefix_caching", "enable_chunked_prefill", "performance_mode"):
            problem = next(filter(None, map(BY_NAME[name].problem, getattr(self, name))), None)
            if problem:
                raise ValueError(problem)
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")

    # ------------------------------------------------------------ candidates
    def batched_tokens_choices(self, base: EngineSettings) -> list[int]:
        """Powers of two within the bounds, plus max_model_len (the smallest budget that
        chunked prefill off accepts) when that is within them, plus the base value."""
        low, high = self.max_num_batched_tokens or (base.max_num_batched_tokens,) * 2
        choices = {1 << k for k in range(0, 31) if low <= (1 << k) <= high}
        if low <= base.max_model_len <= high and False in self.enable_chunked_prefill:
            choices.add(base.max_model_len)
        choices.add(base.max_num_batched_tokens)
        return sorted(choices)

    def seqs_choices(self, base: EngineSettings) -> list[int]:
        """Powers of two within the max_num_seqs bounds, plus the base value."""
        low, high = self.max_num_seqs or (base.max_num_seqs,) * 2
        return sorted({1 << k for k in range(0, 31) if low <= (1 << k) <= high} | {base.max_num_seqs})

    def parallel_choices(self, model: ModelConfig, base: EngineSettings | None = None) -> list[str]:
        """Layouts as 'TPxPP' (one pod) or 'TPxPPxNNODES' strings (`layout_name`): tp x pp
        that the engine's ParallelConfig accepts for this model, with even pipeline stages
        (with `parallel`; else the base's tp x pp), over each nnodes of the range (else the
        base's) that divides tp x pp into at most num_devices ranks per pod; and the base's
        own layout, as the other discrete choices list the base value (feasibility judges it)."""
        pods = range(self.nnodes[0], self.nnodes[1] + 1) if self.nnodes else (base.nnodes if base else 1,)
        most = self.num_devices * max(pods)
        if self.parallel:
            sizes = [(tp, pp) for tp in range(1, most + 1) for pp in range(1, most // tp + 1)]
        else:
            sizes = [(base.tensor_parallel_size, base.pipeline_parallel_size) if base else (1, 1)]
        found = []
        for tp, pp in sizes:
            try:
                ParallelConfig(tp, pp).check_model(model)
            except ValueError:
                continue
            if model.num_layers % pp == 0 or not self.parallel:
                found += [layout_name(tp, pp, n) for n in pods if nnodes_divides(tp * pp, n)
                          and tp * pp // n <= self.num_devices]
        if base is not None:
            own = layout_name(base.tensor_parallel_size, base.pipeline_parallel_size, base.nnodes)
            found = found if own in found else [own, *found]
        return found

    def bounds_with(self, base: EngineSettings) -> SearchSpace:
        """This space widened so that the base (default) settings lie inside it, so the
        defaults can always be enqueued as trial 0 (only the continuous ranges widen; the
        discrete choices list the base value)."""
        def widen(bounds, value):
            return None if bounds is None else (min(bounds[0], value), max(bounds[1], value))
        return SearchSpace(  # the categorical ones include the base value already
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs if self.max_num_seqs_pow2 else widen(self.max_num_seqs, base.max_num_seqs),
            gpu_memory_utilization=widen(self.gpu_memory_utilization, base.gpu_memory_utilization),
            enable_chunked_prefill=tuple(dict.fromkeys((*self.enable_chunked_prefill, base.enable_chunked_prefill)))
            if self.enable_chunked_prefill else (),
            parallel=self.parallel, num_devices=self.num_devices,
            nnodes=widen(self.nnodes, base.nnodes),
            block_size=tuple(dict.fromkeys((*self.block_size, base.block_size))) if self.block_size else (),
            enable_prefix_caching=tuple(dict.fromkeys((*self.enable_prefix_caching, base.enable_prefix_caching)))
            if self.enable_prefix_caching else (),
            max_num_seqs_pow2=self.max_num_seqs_pow2,
            kv_cache_memory_bytes=None if self.kv_cache_memory_bytes is None or base.kv_cache_memory_bytes is None
            else widen(self.kv_cache_memory_bytes, base.kv_cache_memory_bytes),
            performance_mode=tuple(dict.fromkeys((*self.performance_mode, base.performance_mode)))
            if self.performance_mode else (),
        )

    def pin(self, names: tuple[str, ...] | list[str]) -> SearchSpace:
        """This space with the settings `names` (kvpilot.engine.settings.TUNED_SETTINGS names)
        taken out, so every trial keeps their base value (an InferenceService's
        spec.tuning.pinned). Pinning either parallel size pins the whole layout (tp, pp,
        nnodes). Raises ValueError for a name the tuner does not search."""
        unknown = sorted(set(names) - set(TUNED_SETTINGS))
        if unknown:
            raise ValueError(f"cannot pin {unknown}: the tuner searches only {list(TUNED_SETTINGS)}")
        cleared: dict[str, Any] = {}
        for name in names:
            if name in ("tensor_parallel_size", "pipeline_parallel_size"):
                cleared.update(parallel=False, nnodes=None)
            elif name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes"):
                cleared[name] = None
            else:
                cleared[name] = ()
        return dataclasses.replace(self, **cleared)

    # ------------------------------------------------------------ sampling
    def suggest(self, trial: optuna.Trial, base: EngineSettings, model: ModelConfig) -> EngineSettings:
        """The settings of `trial`: base values with the searched ones suggested."""
        values: dict[str, Any] = {}
        if self.max_num_batched_tokens is not None:
            values["max_num_batched_tokens"] = trial.suggest_categorical(
                "max_num_batched_tokens", self.batched_tokens_choices(base))
        if self.max_num_seqs is not None and self.max_num_seqs_pow2:
            values["max_num_seqs"] = trial.suggest_categorical("max_num_seqs", self.seqs_choices(base))
        elif self.max_num_seqs is not None:
            values["max_num_seqs"] = trial.suggest_int("max_num_seqs", *self.max_num_seqs, log=True)
        if self.gpu_memory_utilization is not None:
            values["gpu_memory_utilization"] = trial.suggest_float(
                "gpu_memory_utilization", *self.gpu_memory_utilization)
        if len(self.enable_chunked_prefill) > 1:
            values["enable_chunked_prefill"] = trial.suggest_categorical(
                "enable_chunked_prefill", list(self.enable_chunked_prefill))
        elif self.enable_chunked_prefill:
            values["enable_chunked_prefill"] = self.enable_chunked_prefill[0]
        if self.parallel or self.nnodes:
            choices = self.parallel_choices(model, base)
            if len(choices) > 1:
                tp, pp, nnodes = parse_layout(trial.suggest_categorical("parallel", choices))
                values.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=nnodes)
        if len(self.block_size) > 1:
            values["block_size"] = trial.suggest_categorical("block_size", list(self.block_size))
        if len(self.enable_prefix_caching) > 1:
            values["enable_prefix_caching"] = trial.suggest_categorical(
                "enable_prefix_caching", list(self.enable_prefix_caching))
        if self.kv_cache_memory_bytes is not None:
            values["kv_cache_memory_bytes"] = trial.suggest_int("kv_cache_memory_bytes", *self.kv_cache_memory_bytes,
                                                                log=True)
        if len(self.performance_mode) > 1:
            values["performance_mode"] = trial.suggest_categorical("performance_mode", list(self.performance_mode))
        return base.replace(**values)

    def params_of(self, settings: EngineSettings, model: ModelConfig) -> dict[str, Any]:
        """The study parameters that make `suggest` return `settings` (for
        `study.enqueue_trial`): the inverse of `suggest` over the searched settings."""
        params: dict[str, Any] = {}
        if self.max_num_batched_tokens is not None:
            params["max_num_batched_tokens"] = settings.max_num_batched_tokens
        if self.max_num_seqs is not None:
            params["max_num_seqs"] = settings.max_num_seqs
        if self.gpu_memory_utilization is not None:
            params["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if len(self.enable_chunked_prefill) > 1:
            params["enable_chunked_prefill"] = settings.enable_chunked_prefill
        if (self.parallel or self.nnodes) and len(self.parallel_choices(model, settings)) > 1:
            params["parallel"] = layout_name(settings.tensor_parallel_size, settings.pipeline_parallel_size,
                                             settings.nnodes)
        if len(self.block_size) > 1:
            params["block_size"] = settings.block_size
        if len(self.enable_prefix_caching) > 1:
            params["enable_prefix_caching"] = settings.enable_prefix_caching
        if self.kv_cache_memory_bytes is not None and settings.kv_cache_memory_bytes is not None:
            params["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
        if len(self.performance_mode) > 1:
            params["performance_mode"] = settings.performance_mode
        return params

    def grid(self, base: EngineSettings, max_num_seqs_values: list[int] | None = None) -> list[EngineSettings]:
        """Every combination of the discrete choices (max_num_seqs: the given values, else
        its powers of two), for the full-grid comparison of the tuning-quality benchmark."""
        seqs = max_num_seqs_values or (self.seqs_choices(base) if self.max_num_seqs else [])
        out = [base]
        for name, choices in (("max_num_batched_tokens", self.batched_tokens_choices(base)
                               if self.max_num_batched_tokens else []),
                              ("max_num_seqs", seqs),
                              ("enable_chunked_prefill", list(self.enable_chunked_prefill)),
                              ("block_size", list(self.block_size)),
                              ("enable_prefix_caching", list(self.enable_prefix_caching))):
            if choices:
                out = [s.replace(**{name: c}) for s in out for c in choices]
        return list(dict.fromkeys(out))


def layout_name(tensor_parallel_size: int, pipeline_parallel_size: int, nnodes: int = 1) -> str:
    """The study's value for a layout: 'TPxPP' on one pod (as studies before nnodes named
    it), 'TPxPPxNNODES' over several, e.g. '2x1x2': tp 2, pp 1 over 2 pods."""
    name = f"{tensor_parallel_size}x{pipeline_parallel_size}"
    return name if nnodes == 1 else f"{name}x{nnodes}"


def parse_layout(name: str) -> tuple[int, int, int]:
    """(tensor_parallel_size, pipeline_parallel_size, nnodes) of a `layout_name`."""
    tp, pp, *pods = (int(part) for part in name.split("x"))
    return tp, pp, pods[0] if pods else 1


def ranges_markdown() -> str:
    """The default search ranges as the user guide's Markdown table (docs/guide.md holds
    this text; a test compares them)."""
    lines = ["| setting | `kvpilot tune` flag | default search range |", "|---|---|---|"]
    for name, (low, high) in SEARCH_RANGES.items():
        lines.append(f"| `{name}` | `{BY_NAME[name].flag} LOW:HIGH` | {low} to {high} |")
    return "\n".join(lines)
