"""Guided proposals: what the tuner knows before and between measurements, used to choose
trials that Optuna's sampler would only reach by chance with a budget of a few deployments.

- A memory-model point (`kv_fit_settings`): the KV cache holds `num_blocks` blocks (the
  feasibility model's prediction, or --num-gpu-blocks-override); a sequence of T tokens
  needs ceil(T / block_size) of them, so at most num_blocks // that many sequences run
  without preemption (vLLM's "max concurrency" line at startup). With the workload's
  longest request that cap guarantees no preemption; with its mean request it is what the
  cache holds on average. Both are proposed right after the defaults when they lower the
  defaults' max_num_seqs and the defaults' measurement preempted or failed (vLLM's
  tuning guide: preemptions mean max_num_seqs is too high for the cache; without them a
  lower max_num_seqs only queues requests).
- More KV cache (`more_cache_settings`), the guide's first remedy for preemptions, before the
  memory-model points when the search has the KV cache's bytes as an axis: the largest cache
  the space allows (dropped with them when the defaults did not preempt).
- A repair point when the defaults break the inter-token latency SLO. On a GPU: chunked
  prefill on with a small token budget (the guide: "smaller max_num_batched_tokens gives
  better ITL"; the chunked-prefill study: below ~256 tokens the total time grows, so 256
  or the nearest choice below it): a GPU decode step is memory-bound and carries a small
  prefill chunk almost for free. On a CPU engine (`Hardware.shared_memory`) a step is
  compute-bound and pays for every token it carries, so a chunk slows every decode step it
  rides in; the repair there is chunked prefill off (prefills in steps of their own, the
  budget at least max_model_len), measured in benchmarks/results/tuning/README.md (itl).
- Neighbour moves (compass / Hooke-Jeeves pattern search): from the best feasible trial so
  far (then the others, the least violating first), first the pattern move (when the best
  came from a move of its own, the same step once more along that axis), then the settings
  a step away on one axis (budget or max_num_seqs choices; chunked prefill flipped), in
  random order, the step coarse first (half the longest axis) and halved when every
  setting at that step was tried; only settings not tried yet that the memory model
  accepts. The
  engine's response to each limit is smooth (the guide's and the study's curves), so the
  best point is usually next to a good one, and a step that helped tends to help again.
  When no such neighbour is left the sampler (TPE / GP with the SLO constraints) proposes.
Nothing here reads measured values other than the study's own trials.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from kvpilot.engine.config import ModelConfig
from kvpilot.tuner.search import feasibility
from kvpilot.tuner.search.objective import CONSTRAINTS_ATTR, SLO, constraint_names, is_feasible
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace

SMALL_BUDGET = 256  # tokens: the chunked-prefill study's knee (DESIGN.md)


@dataclass(frozen=True)
class RequestTokens:
    """The workload's request sizes in tokens (prompt + output): mean and longest."""

    mean: float
    longest: int


def kv_fit_seqs(num_blocks: int, block_size: int, tokens: float) -> int:
    """How many sequences of `tokens` tokens fit in `num_blocks` KV blocks at once (>= 1)."""
    return max(1, num_blocks // max(1, math.ceil(tokens / block_size)))


def _seqs_at_most(space: SearchSpace, base: EngineSettings, cap: int) -> int | None:
    """The largest max_num_seqs the space can propose that is <= cap (None: none)."""
    if space.max_num_seqs is None:
        return None
    if space.max_num_seqs_pow2:
        fits = [s for s in space.seqs_choices(base) if s <= cap]
        return max(fits) if fits else None
    low, high = space.max_num_seqs
    return min(high, cap) if cap >= low else None


def _budget_for(space: SearchSpace, base: EngineSettings, seqs: int, want: int) -> int:
    """The budget choice nearest below `want` that is >= seqs (the engine's rule), else
    the smallest choice >= seqs, else the base budget."""
    if space.max_num_batched_tokens is None:
        return base.max_num_batched_tokens
    choices = [b for b in space.batched_tokens_choices(base) if b >= seqs]
    below = [b for b in choices if b <= want]
    return max(below) if below else (min(choices) if choices else base.max_num_batched_tokens)


def kv_fit_settings(base: EngineSettings, space: SearchSpace, model: ModelConfig, hardware: feasibility.Hardware,
                    tokens: RequestTokens | None) -> list[EngineSettings]:
    """The memory-model points (longest request first, then the mean one) that lower the
    base max_num_seqs, with the base budget (raised to max_num_seqs when needed). Without
    workload lengths (live traffic) the longest request is max_model_len."""
    verdict = feasibility.check(base, model, hardware)
    if not verdict.num_blocks:
        return []
    sizes = [tokens.longest, tokens.mean] if tokens else [base.max_model_len]
    out = []
    for size in sizes:
        seqs = _seqs_at_most(space, base, kv_fit_seqs(verdict.num_blocks, base.block_size, size))
        if seqs is None or seqs >= base.max_num_seqs:
            continue
        budget = base.max_num_batched_tokens if base.max_num_batched_tokens >= seqs else \
            _budget_for(space, base, seqs, base.max_num_batched_tokens)
        point = base.replace(max_num_seqs=seqs, max_num_batched_tokens=budget)
        if point not in out:
            out.append(point)
    return out


def more_cache_settings(base: EngineSettings, space: SearchSpace) -> list[EngineSettings]:
    """The guide's first remedy for preemptions, more KV cache memory, where the search has the
    axis: the base with the largest `kv_cache_memory_bytes` the space allows (an opt-in axis:
    `--kv-cache-memory-bytes LOW:HIGH`), else nothing. Proposed before the memory-model points
    that lower max_num_seqs: a larger cache removes preemptions without queueing requests."""
    bounds = space.kv_cache_memory_bytes
    if bounds is None or base.kv_cache_memory_bytes is None or bounds[1] <= base.kv_cache_memory_bytes:
        return []
    return [base.replace(kv_cache_memory_bytes=bounds[1])]


def repair_settings(defaults: EngineSettings, violated: set[str], space: SearchSpace,
                    base: EngineSettings, cpu: bool = False) -> list[EngineSettings]:
    """Points the tuning guide recommends for the SLOs the defaults broke (see module doc);
    cpu: the engine runs on CPUs (compute-bound steps)."""
    out: list[EngineSettings] = []
    if "itl_p95_ms" not in violated:
        return out
    if cpu:
        if defaults.enable_chunked_prefill and False in space.enable_chunked_prefill:
            budget = defaults.max_num_batched_tokens
            if budget < defaults.max_model_len:
                budget = _budget_for(space, base, defaults.max_model_len, defaults.max_model_len)
            out.append(defaults.replace(enable_chunked_prefill=False, max_num_batched_tokens=budget))
        return out
    if True in space.enable_chunked_prefill and space.max_num_batched_tokens:
        budget = _budget_for(space, base, defaults.max_num_seqs, SMALL_BUDGET)
        if budget < defaults.max_num_batched_tokens or not defaults.enable_chunked_prefill:
            out.append(defaults.replace(enable_chunked_prefill=True, max_num_batched_tokens=budget))
    return out


def _axes(space: SearchSpace, base: EngineSettings) -> dict[str, list[Any]]:
    """The ordered values of each axis neighbour moves walk along."""
    axes: dict[str, list[Any]] = {}
    if space.max_num_batched_tokens is not None:
        axes["max_num_batched_tokens"] = space.batched_tokens_choices(base)
    if space.max_num_seqs is not None:
        if space.max_num_seqs_pow2:
            axes["max_num_seqs"] = space.seqs_choices(base)
        else:  # log-uniform integers: walk by factors of two within the bounds
            low, high = space.max_num_seqs
            axes["max_num_seqs"] = sorted({*space.seqs_choices(base), low, high})
    if len(space.enable_chunked_prefill) > 1:
        axes["enable_chunked_prefill"] = list(space.enable_chunked_prefill)
    return axes


def neighbours(settings: EngineSettings, space: SearchSpace, base: EngineSettings,
               step: int = 1) -> list[EngineSettings]:
    """Settings `step` choices away from `settings` on one axis (clamped to the axis' ends),
    and chunked prefill flipped."""
    out = []
    for name, values in _axes(space, base).items():
        current = getattr(settings, name)
        if name == "enable_chunked_prefill":
            out += [settings.replace(enable_chunked_prefill=v) for v in values if v != current]
            continue
        i = values.index(current) if current in values else min(range(len(values)),
                                                                  key=lambda k: abs(values[k] - current))
        for k in {max(0, i - step), min(len(values) - 1, i + step)} - {i}:
            out.append(settings.replace(**{name: values[k]}))
    return out


def steps(space: SearchSpace, base: EngineSettings) -> list[int]:
    """Compass-search step sizes, coarse to fine: half the longest axis, halved down to 1."""
    longest = max((len(v) for v in _axes(space, base).values()), default=2)
    out, step = [], max(1, (longest - 1 + 1) // 2)
    while step >= 1:
        out.append(step)
        step //= 2
    return out


def pattern_move(settings: EngineSettings, parent: EngineSettings, space: SearchSpace,
                 base: EngineSettings) -> EngineSettings | None:
    """The step parent -> settings repeated once more (one ordered axis), else None."""
    for name, values in _axes(space, base).items():
        if name == "enable_chunked_prefill" or getattr(settings, name) == getattr(parent, name):
            continue
        i, j = values.index(getattr(parent, name)), values.index(getattr(settings, name))
        k = j + (j - i)
        return settings.replace(**{name: values[k]}) if 0 <= k < len(values) else None
    return None


def _violation(t: optuna.trial.FrozenTrial, slo: SLO) -> float:
    """Sum of each constraint's violation relative to its limit (0 when feasible)."""
    limits = {"ttft_p95_ms": slo.ttft_p95_ms, "itl_p95_ms": slo.itl_p95_ms, "e2e_p95_ms": slo.e2e_p95_ms,
              "preemptions_per_min": max(slo.max_preemptions_per_min, 1.0), "failed_requests": 1.0}
    values = t.user_attrs.get(CONSTRAINTS_ATTR) or []
    return sum(max(0.0, v) / limits[n] for n, v in zip(constraint_names(slo), values))


class Guide:
    """Proposes the next trial's settings, or None to let the sampler choose."""

    def __init__(self, space: SearchSpace, base: EngineSettings, model: ModelConfig,
                 hardware: feasibility.Hardware, slo: SLO, tokens: RequestTokens | None, seed: int = 0):
        self.space, self.base, self.model, self.hardware, self.slo = space, base, model, hardware, slo
        self.tokens, self.rng = tokens, random.Random(seed)
        self.seeds = more_cache_settings(base, space) + kv_fit_settings(base, space, model, hardware, tokens)
        self.repaired = False

    def _tried(self, study: optuna.Study) -> list[EngineSettings]:
        return [EngineSettings(**t.user_attrs["settings"]) for t in study.get_trials(deepcopy=False)
                if t.user_attrs.get("settings") and t.state != TrialState.FAIL]

    def _ok(self, s: EngineSettings, tried: list[EngineSettings]) -> bool:
        return s not in tried and feasibility.check(s, self.model, self.hardware).feasible

    def propose(self, study: optuna.Study) -> EngineSettings | None:
        """The next settings to try, or None; its center (the trial it moves from) is
        in `self.center` for the trial's user attributes."""
        self.center = None
        tried = self._tried(study)
        measured = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get("verdict") in ("measured", "violates_slo") and "remeasure_of" not in t.user_attrs]
        defaults = next((t for t in measured if t.user_attrs.get("is_defaults")), None)
        if defaults is not None and not self.repaired:
            self.repaired = True
            violated = {n for n, v in zip(constraint_names(self.slo), defaults.user_attrs[CONSTRAINTS_ATTR]) if v > 0}
            if not (defaults.user_attrs.get("measurement") or {}).get("preemptions"):
                self.seeds = []  # only memory-model points so far: the cache held the defaults' batch
            self.seeds += repair_settings(EngineSettings(**defaults.user_attrs["settings"]), violated, self.space,
                                          self.base, cpu=self.hardware.shared_memory)
        for s in self.seeds:
            if self._ok(s, tried):
                return s
        maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
        feasible = [t for t in measured if is_feasible(t.user_attrs.get(CONSTRAINTS_ATTR))]
        ranked = sorted(feasible, key=lambda t: t.values[0], reverse=maximize) + \
            sorted((t for t in measured if t not in feasible), key=lambda t: _violation(t, self.slo))
        for t in ranked:
            center = EngineSettings(**t.user_attrs["settings"])
            self.center = center.as_dict()
            parent = t.user_attrs.get("guided_from")
            if parent:
                again = pattern_move(center, EngineSettings(**parent), self.space, self.base)
                if again is not None and self._ok(again, tried):
                    return again
            for step in steps(self.space, self.base):
                options = [s for s in neighbours(center, self.space, self.base, step) if self._ok(s, tried)]
                if options:
                    return self.rng.choice(options)
        self.center = None
        return None
