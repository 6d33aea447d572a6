"""Capacity: for one setting, the highest request rate at which every SLO still holds.

A bounded search over Poisson request rates on a log scale: probe the low and high ends,
then bisect (geometric midpoints) for `steps` more windows, assuming latency only worsens
as the rate rises. The tuner can maximise this capacity instead of goodput at a fixed rate
(`--objective capacity`), the question a capacity planner asks: how many requests per second
can one replica take within the SLOs?
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvpilot.tuner.search.objective import SLO, Measurement, is_feasible, slack


def find_capacity(measure: Callable[[float], Measurement], slo: SLO, low_rps: float, high_rps: float,
                  steps: int = 3) -> Measurement:
    """The window at the highest sustainable rate probed, with `capacity_rps` set (0 and
    the lowest rate's window when even `low_rps` breaks an SLO) and every probe listed in
    extra['capacity_probes'] as (rate, feasible). Raises ValueError on bad bounds."""
    if not 0 < low_rps < high_rps:
        raise ValueError(f"capacity bounds must satisfy 0 < low < high requests/s, got {low_rps}, {high_rps}")
    probes: list[tuple[float, bool]] = []

    def probe(rate: float) -> tuple[bool, Measurement]:
        m = measure(rate)
        ok = is_feasible(slack(m, slo))
        probes.append((round(rate, 4), ok))
        return ok, m

    ok, best = probe(low_rps)
    if not ok:
        best.capacity_rps = 0.0
    else:
        best.capacity_rps = low_rps
        ok_high, m_high = probe(high_rps)
        if ok_high:
            best, best.capacity_rps = m_high, high_rps
        else:
            lo, hi = low_rps, high_rps
            for _ in range(steps):
                mid = math.sqrt(lo * hi)
                ok_mid, m_mid = probe(mid)
                if ok_mid:
                    lo, best = mid, m_mid
                    best.capacity_rps = mid
                else:
                    hi = mid
    best.extra["capacity_probes"] = probes
    return best
