"""When live traffic calls for a new study: the watch policy after a study, pure (no I/O;
the clock is injected).

Every window the driver hands over what it measured and the workload's shape
(`observe_window` of a measurement source). A study should start when the SLOs were broken
for `breach_windows` windows in a row (SLOBreached: what users feel, judged first) or when
a figure of the shape moved by more than `shift_ratio` from the shape the settings were
tuned on for `shift_windows` windows in a row (WorkloadShifted; the ratio test and why are
in `kvpilot.tuner.measure.shape`). Consecutive windows play the part of the HPA's stabilization
window: one odd window starts nothing. A window with fewer than `min_requests` finished
requests judges nothing (its p95s are a handful of samples) and leaves the counts as they
are. Guard rails hold a trigger back while a study runs, for a cool-down after one ends and
beyond a cap of studies per sliding hour; the counts keep counting meanwhile, so a
condition that still holds fires as soon as the guard rail lets it.

Window size matters more than the ratio: quantiles of a few dozen heavy-tailed prompt
lengths are noisy. Simulated (Poisson arrivals, log-normal prompts with sigma 0.8, 1-2-5
buckets, 200 hours each; `test_tuner_watch.py`'s sampled traffic), with the reference one
60 s window: no false start at 1 req/s (about 60 requests a window), 10 % of hours with
one at 0.5 req/s, 47 % at 0.2 req/s (mostly prompt p90); a reference over ten times the
requests brings 0.5 req/s to 0.5 %. So give windows about 60 requests (a longer window_s at
low rates) and take the reference from the study's whole traffic, not one window.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.spec import TuningSpec
from kvpilot.tuner.search.objective import INFEASIBLE, SLO, Measurement, violations
from kvpilot.tuner.measure.shape import FIGURES, WorkloadShape, shifted

SLO_BREACHED, WORKLOAD_SHIFTED = "SLOBreached", "WorkloadShifted"
HOUR_S = 3600.0

_SPEC = TuningSpec()  # spec.tuning's defaults (the CRD's: tests/operator/test_crd_generated.py)


@dataclass(frozen=True)
class WatchConfig:
    """window_s: one watch window (s; the driver sleeps it); breach_windows: consecutive
    windows breaking an SLO that start a study; shift_ratio, shift_windows: a shape figure
    moving by more than this factor from the tuned-on shape for this many consecutive
    windows starts one; min_requests: fewer finished requests in a window judge nothing;
    cooldown_s: no study starts within this long after the last ended; max_studies_per_hour:
    cap over a sliding hour; reference_windows: judged windows whose figures' medians make
    the reference when there is none (after a study: the traffic its settings serve). Raises
    ValueError on values that cannot work."""

    window_s: float = float(_SPEC.watchSeconds)
    breach_windows: int = _SPEC.breachWindows
    shift_ratio: float = _SPEC.shiftRatio
    shift_windows: int = 2
    min_requests: int = 10
    cooldown_s: float = float(_SPEC.cooldownSeconds)
    max_studies_per_hour: int = _SPEC.maxStudiesPerHour
    reference_windows: int = 3

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {self.window_s}")
        if self.breach_windows < 1 or self.shift_windows < 1:
            raise ValueError(f"breach_windows and shift_windows must be >= 1, got "
                             f"{self.breach_windows} and {self.shift_windows}")
        if not self.shift_ratio > 1:
            raise ValueError(f"shift_ratio must be > 1 (a factor, 2 = twice or half), got {self.shift_ratio}")
        if self.min_requests < 1 or self.max_studies_per_hour < 1 or self.cooldown_s < 0 or self.reference_windows < 1:
            raise ValueError(f"min_requests, max_studies_per_hour and reference_windows must be >= 1 and cooldown_s "
                             f">= 0, got {self.min_requests}, {self.max_studies_per_hour}, {self.reference_windows}, "
                             f"{self.cooldown_s}")


@dataclass(frozen=True)
class Trigger:
    """Why a study should start: reason SLO_BREACHED or WORKLOAD_SHIFTED, a message for a
    Kubernetes Event or condition with the figures, and the figures themselves (JSON-able)."""

    reason: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowVerdict:
    """What one window showed. attainment: the share of its requests within every SLO
    (goodput_rps / throughput_rps; NaN without requests); violations: {constraint: measured
    - limit} (`kvpilot.tuner.search.objective.violations`; {} when the window judged nothing);
    shift: {figure: (reference, now)} past the ratio; breached_windows, shifted_windows: the
    consecutive counts so far; trigger: a study should start now; held: a trigger a guard
    rail holds back, and why."""

    attainment: float
    violations: dict[str, float]
    shift: dict[str, tuple[float, float]]
    breached_windows: int
    shifted_windows: int
    trigger: Trigger | None = None
    held: str | None = None


def _limits(slo: SLO) -> dict[str, float]:
    return {"ttft_p95_ms": slo.ttft_p95_ms, "itl_p95_ms": slo.itl_p95_ms, "e2e_p95_ms": slo.e2e_p95_ms,
            "preemptions_per_min": slo.max_preemptions_per_min, "failed_requests": 0.0}


def _number(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def breach_message(broken: dict[str, float], slo: SLO, windows: int, failed: int = 0) -> str:
    """'SLOs broken 3 windows in a row: ttft_p95_ms 5200 > 2000, ...' from `violations`'
    excesses (measured = limit + excess; 'no samples' where nothing was measured; the
    `failed` count where no request completed, which `slack` marks infeasible)."""
    limits = _limits(slo)
    broken = {**broken, **({"failed_requests": float(failed)} if "failed_requests" in broken and failed else {})}
    parts = [f"{name}: no samples" if excess >= INFEASIBLE / 2
             else f"{name} {_number(limits[name] + excess)} > {_number(limits[name])}"
             for name, excess in broken.items()]
    return f"SLOs broken {windows} windows in a row: " + ", ".join(parts)


def shift_message(moved: dict[str, tuple[float, float]], windows: int) -> str:
    """'workload shifted for 2 windows: prompt_tokens_p50 210 -> 880 (x4.2), ...'."""
    parts = [f"{name} {_number(ref)} -> {_number(now)} (x{now / ref:.2g})" for name, (ref, now) in moved.items()]
    return f"workload shifted for {windows} windows: " + ", ".join(parts)


class Watcher:
    """Judges watch windows against the SLOs and the tuned-on workload (`reference`; None:
    the first judged window becomes it). clock: seconds, monotonic (guard rails only)."""

    def __init__(self, slo: SLO, config: WatchConfig, reference: WorkloadShape | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.slo, self.config, self.reference, self.clock = slo, config, reference, clock
        self.breached_windows = 0
        self.shifted_windows = 0
        self.studying = False
        self.cooldown_until = -math.inf
        self.study_starts: deque[float] = deque()
        self._building: list[WorkloadShape] = []  # judged windows toward a reference

    def observe(self, m: Measurement, shape: WorkloadShape) -> WindowVerdict:
        """Judges one window: SLO breach first, then shift. A window with fewer than
        min_requests finished requests (completed or failed: a window where every request
        fails is judged) judges nothing and keeps the counts."""
        attainment = m.goodput_rps / m.throughput_rps if m.throughput_rps > 0 else math.nan
        if m.completed + m.failed < self.config.min_requests:
            return WindowVerdict(attainment, {}, {}, self.breached_windows, self.shifted_windows)
        broken = violations(m, self.slo)
        self.breached_windows = self.breached_windows + 1 if broken else 0
        moved: dict[str, tuple[float, float]] = {}
        if shape.requests >= self.config.min_requests:  # quantiles of a handful of requests say little
            if self.reference is None:
                self._building.append(shape)
                if len(self._building) >= self.config.reference_windows:
                    self.reference, self._building = median_shape(self._building), []
            else:
                moved = shifted(self.reference, shape, self.config.shift_ratio)
                self.shifted_windows = self.shifted_windows + 1 if moved else 0
        trigger = self._trigger(m, broken, moved, attainment, shape)
        held = self._held() if trigger else None
        if held:
            held, trigger = f"{trigger.reason} held back by {held}", None
        return WindowVerdict(attainment, broken, moved, self.breached_windows, self.shifted_windows, trigger, held)

    def _trigger(self, m: Measurement, broken: dict[str, float], moved: dict[str, tuple[float, float]],
                 attainment: float, shape: WorkloadShape) -> Trigger | None:
        figures: dict[str, Any] = {"attainment": None if math.isnan(attainment) else attainment,
                                   "shape": shape.as_dict()}
        if broken and self.breached_windows >= self.config.breach_windows:
            return Trigger(SLO_BREACHED, breach_message(broken, self.slo, self.breached_windows, m.failed),
                           {**figures, "windows": self.breached_windows, "violations": dict(broken)})
        if moved and self.shifted_windows >= self.config.shift_windows:
            reference = self.reference.as_dict() if self.reference else None
            return Trigger(WORKLOAD_SHIFTED, shift_message(moved, self.shifted_windows),
                           {**figures, "windows": self.shifted_windows, "reference": reference,
                            "shifted": {k: list(v) for k, v in moved.items()}})
        return None

    def _held(self) -> str | None:
        """Why a guard rail holds a trigger back now, or None."""
        now = self.clock()
        while self.study_starts and self.study_starts[0] <= now - HOUR_S:
            self.study_starts.popleft()
        if self.studying:
            return "a study running"
        if now < self.cooldown_until:
            return f"cool-down: {self.cooldown_until - now:.0f} s left"
        if len(self.study_starts) >= self.config.max_studies_per_hour:
            wait = self.study_starts[0] + HOUR_S - now
            return f"cap: {len(self.study_starts)} studies in the last hour (next in {wait:.0f} s)"
        return None

    def study_started(self) -> None:
        """Records a study's start (for the per-hour cap); triggers are held until it ends."""
        self.studying = True
        self.study_starts.append(self.clock())

    def rebuild_reference(self) -> None:
        """Forgets the reference: the next `reference_windows` judged windows make a new one
        (after a study, the traffic its settings serve)."""
        self.reference, self._building = None, []

    def study_ended(self, reference: WorkloadShape | None) -> None:
        """The study's workload becomes the reference (None keeps the old one), the counts
        reset and the cool-down starts."""
        if reference is not None:
            self.reference = reference
        self.studying = False
        self.breached_windows = self.shifted_windows = 0
        self.cooldown_until = self.clock() + self.config.cooldown_s


def median_shape(shapes: list[WorkloadShape]) -> WorkloadShape:
    """The figure-by-figure median of several windows' shapes (NaN figures left out), with
    their requests and durations summed: a reference steadier than any one window."""
    def median(name: str) -> float:
        values = sorted(v for s in shapes if not math.isnan(v := getattr(s, name)))
        return statistics.median(values) if values else math.nan

    return WorkloadShape(duration_s=sum(s.duration_s for s in shapes), requests=sum(s.requests for s in shapes),
                         **{name: median(name) for name in FIGURES})
