"""Noise-aware choices: a trial's figure over repeated windows, and whether the tuner's
winner may replace the running settings (the incumbent).

On a shared machine the same settings measure differently from one window to the next
(the tuning-quality benchmark saw 0.97 and 1.41 req/s for one point), so:
- `window_figure`: a trial measures a second window, and when the two differ by more than
  `wide` (relative to their median) keeps measuring up to `max_windows`; its figure is the
  median window (a real window, so its latencies stay consistent), and the spread
  (max - min of the objective over the windows) is kept with it;
- `decide`: the winner (best median after the re-measurements) replaces a feasible
  incumbent only when its median beats the incumbent's by more than the measured noise,
  half the larger of the two spreads (max - min over their windows), i.e. the medians
  differ by more than either figure moves around its own middle. An incumbent that breaks the SLOs is replaced by any
  feasible winner: meeting the SLOs is the point. Without a second window of both (the
  user turned re-measurement off) there is no spread: the single windows decide, and the
  decision says so (noise None).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpilot.tuner.search.objective import Measurement


def relative_spread(values: Sequence[float]) -> float:
    """(max - min) / |median| of a figure's windows; 0 for one window, inf around 0."""
    if len(values) < 2:
        return 0.0
    mid = abs(statistics.median(values))
    return (max(values) - min(values)) / mid if mid > 0 else (0.0 if max(values) == min(values) else float("inf"))


def window_figure(measure: Callable[[], Measurement], figure: Callable[[Measurement], float],
                  max_windows: int, wide: float) -> tuple[Measurement, list[float]]:
    """Measures 1 window (max_windows <= 1), else 2, and more up to max_windows while the
    windows' relative spread exceeds `wide`. Returns the median window (the lower middle
    one for an even count, by `figure`) and every window's figure, in order."""
    windows = [measure()]
    while len(windows) < max(1, max_windows):
        if len(windows) >= 2 and relative_spread([figure(w) for w in windows]) <= wide:
            break
        windows.append(measure())
    ordered = sorted(windows, key=figure)
    return ordered[(len(ordered) - 1) // 2], [figure(w) for w in windows]


@dataclass(frozen=True)
class Decision:
    """replace: deploy the winner instead of the incumbent. margin: winner median minus
    incumbent median (objective units, None without a feasible incumbent); noise: half the
    larger spread (max - min) of the two's runs, None when either ran once."""

    replace: bool
    reason: str
    winner: int | None
    incumbent: int | None
    margin: float | None
    noise: float | None

    def as_dict(self) -> dict[str, Any]:
        """The decision as the report's JSON keeps it (field name -> value)."""
        return asdict(self)


def decide(winner: dict[str, Any] | None, incumbent: dict[str, Any] | None, maximize: bool = True) -> Decision:
    """winner / incumbent: {'number', 'runs': [objective per window], 'feasible': bool};
    the winner is feasible by construction (the best of the ranking)."""
    if winner is None:
        return Decision(False, "no trial met the SLOs: keep the running settings", None,
                        incumbent and incumbent["number"], None, None)
    if incumbent is None or not incumbent["feasible"]:
        return Decision(True, "the running settings break the SLOs; the winner meets them", winner["number"],
                        incumbent and incumbent["number"], None, None)
    if winner["number"] == incumbent["number"]:
        return Decision(False, "the running settings are the best found", winner["number"], incumbent["number"],
                        0.0, None)
    sign = 1.0 if maximize else -1.0
    margin = sign * (statistics.median(winner["runs"]) - statistics.median(incumbent["runs"]))
    if len(winner["runs"]) < 2 or len(incumbent["runs"]) < 2:  # re-measurements off (--remeasure-top 0)
        return Decision(margin > 0, f"margin {margin:.3g} on single windows: no spread measured "
                        f"(re-measurements off), decided on the windows alone", winner["number"],
                        incumbent["number"], margin, None)
    noise = max(max(r["runs"]) - min(r["runs"]) for r in (winner, incumbent)) / 2
    if margin > noise:
        return Decision(True, f"beats the running settings by {margin:.3g} > noise {noise:.3g}", winner["number"],
                        incumbent["number"], margin, noise)
    return Decision(False, f"margin {margin:.3g} within the noise {noise:.3g}: keep the running settings",
                    winner["number"], incumbent["number"], margin, noise)
