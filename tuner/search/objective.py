"""What a trial measured, the SLOs it is judged against, and what Optuna is told.

Default objective: maximise goodput, the requests per second that met every SLO (DistServe's
definition, which vLLM's `benchmark_serving --goodput` uses), subject to constraints on the
window's p95 time to first token, p95 inter-token latency and preemptions per minute.
Constraints follow Optuna's contract (`Trial.set_constraint`, and `constraints_func` of
`optuna.samplers.TPESampler` / `GPSampler` before Optuna 5): each value is
`measured - limit`, and a trial is feasible when every value is <= 0. The values are also
kept in the trial's user attributes, so `constraints_func` only reads them back. A trial
the tuner could not measure (infeasible, failed) is still told, COMPLETE with a dominated
value and violated constraints (`kvpilot.tuner.search.loop`): TPE and GP condition on nothing else.
A multi-objective mode maximises throughput and minimises a p95 latency (Pareto front);
'capacity' maximises the highest request rate that meets the SLOs (`kvpilot.tuner.search.capacity`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

CONSTRAINTS_ATTR = "constraints"
INFEASIBLE = 1e9  # marks a constraint without a sample; the loop tells a finite penalty instead
OBJECTIVES = ("goodput", "throughput", "capacity", "multi")
LATENCIES = ("ttft", "itl", "e2e")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives, in milliseconds and preemptions per minute; 0 disables
    the latency ones (not the preemption limit, where 0 means none allowed).
    Per request, goodput counts TTFT <= ttft_p95_ms and TPOT (its mean ITL) <= itl_p95_ms."""

    ttft_p95_ms: float = 2000.0
    itl_p95_ms: float = 200.0
    e2e_p95_ms: float = 0.0
    max_preemptions_per_min: float = 0.0

    def goodput_slos_ms(self) -> dict[str, float]:
        """The per-request limits in `kvpilot.loadgen.metrics.calculate_metrics`'s form."""
        slos = {"ttft": self.ttft_p95_ms, "tpot": self.itl_p95_ms, "e2el": self.e2e_p95_ms}
        return {k: v for k, v in slos.items() if v > 0}


@dataclass
class Measurement:
    """One measured window. Rates per second, latencies in seconds (NaN when the window
    had no such samples), preemptions counted over the window.

    source says where the latencies and preemptions came from ('scrape', 'prometheus',
    'client'); goodput comes from the client's per-request timings when the tuner drove
    the load, else it is estimated from the server histograms."""

    duration_s: float
    completed: int
    failed: int = 0
    throughput_rps: float = 0.0
    goodput_rps: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_p95_s: float = math.nan
    itl_p95_s: float = math.nan
    tpot_p95_s: float = math.nan
    e2e_p95_s: float = math.nan
    preemptions: float = 0.0
    capacity_rps: float = math.nan
    source: str = "client"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def preemptions_per_min(self) -> float:
        """Preemptions over the window scaled to one minute (0 for a window of no duration)."""
        return self.preemptions * 60.0 / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able fields (NaN as None) plus preemptions_per_min, as trial user attributes keep them."""
        d = asdict(self)
        d["preemptions_per_min"] = self.preemptions_per_min
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        """The inverse of as_dict (None back to NaN); unknown keys, such as preemptions_per_min, are dropped."""
        known = {k: (math.nan if v is None else v) for k, v in d.items()
                 if k in cls.__dataclass_fields__ and k != "extra"}
        return cls(**known, extra=dict(d.get("extra") or {}))


def _ms(seconds: float) -> float:
    return seconds * 1000.0 if not math.isnan(seconds) else INFEASIBLE


def constraint_names(slo: SLO) -> list[str]:
    """The constraints, in the order `slack` returns them."""
    names = []
    if slo.ttft_p95_ms > 0:
        names.append("ttft_p95_ms")
    if slo.itl_p95_ms > 0:
        names.append("itl_p95_ms")
    if slo.e2e_p95_ms > 0:
        names.append("e2e_p95_ms")
    return names + ["preemptions_per_min", "failed_requests"]


def slack(m: Measurement, slo: SLO) -> list[float]:
    """measured - limit for every constraint (<= 0 is feasible), in `constraint_names`
    order. A window without latency samples (nothing completed) is infeasible; every
    failed request is a violation."""
    out = []
    if slo.ttft_p95_ms > 0:
        out.append(_ms(m.ttft_p95_s) - slo.ttft_p95_ms)
    if slo.itl_p95_ms > 0:
        out.append(_ms(m.itl_p95_s) - slo.itl_p95_ms)
    if slo.e2e_p95_ms > 0:
        out.append(_ms(m.e2e_p95_s) - slo.e2e_p95_ms)
    out.append(m.preemptions_per_min - slo.max_preemptions_per_min)
    out.append(float(m.failed) if m.completed else INFEASIBLE)
    return out


def violations(m: Measurement, slo: SLO) -> dict[str, float]:
    """{constraint: measured - limit} for the violated constraints (names as in
    `constraint_names`; ms for latencies, preemptions per minute, failed requests)."""
    return {n: round(v, 3) for n, v in zip(constraint_names(slo), slack(m, slo)) if v > 0}


def constraints_func(trial: optuna.trial.FrozenTrial) -> list[float]:
    """Optuna's `constraints_func` (Optuna 4): the slack stored on the trial. The loop
    stores it on every trial it tells COMPLETE, failed and infeasible ones included (with
    the penalty of `kvpilot.tuner.search.loop.penalty_constraints`), so the sampler learns to
    avoid their region; a trial without it is treated as violating."""
    values = trial.user_attrs.get(CONSTRAINTS_ATTR)
    if values is None:
        return [INFEASIBLE]
    return [float(v) for v in values]


def is_feasible(constraints: list[float] | None) -> bool:
    """Whether every constraint value (`slack`) is <= 0, Optuna's feasibility rule; None is infeasible."""
    return constraints is not None and all(v <= 0 for v in constraints)


def directions(objective: str) -> list[str]:
    """Optuna study directions for an objective name."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return ["maximize", "minimize"] if objective == "multi" else ["maximize"]


def values(m: Measurement, objective: str, latency: str = "e2e") -> list[float]:
    """What Optuna is told: [goodput], [throughput] or [capacity] (requests/s), or for
    'multi' [throughput requests/s, p95 `latency` in ms]."""
    if objective == "goodput":
        return [m.goodput_rps]
    if objective == "capacity":
        return [0.0 if math.isnan(m.capacity_rps) else m.capacity_rps]
    if objective == "throughput":
        return [m.throughput_rps]
    p95 = {"ttft": m.ttft_p95_s, "itl": m.itl_p95_s, "e2e": m.e2e_p95_s}[latency]
    return [m.throughput_rps, _ms(p95)]
