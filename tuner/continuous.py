"""Continuous tuning: after its study the tuner keeps watching the live traffic and re-tunes
when the SLOs break or the workload moves (spec.tuning.mode continuous; `kvpilot tune
--local --continuous`).

The session, on either site (`Site`: local engine processes or an InferenceService):
1. runs the first study (or resumes the last one) and deploys its winner;
2. every watch window reads, from the same series the trials are measured on, the SLO
   attainment and the workload's shape (`Source.observe_window`), publishes both (status,
   the tuner's Prometheus series) and hands them to the `kvpilot.tuner.watch.Watcher`;
3. when the watcher fires (SLOBreached: the SLOs broke K windows in a row; WorkloadShifted:
   the shape moved past the ratio), and its guard rails (cool-down, studies per hour) allow
   it, posts an event with the figures and starts a new study seeded from the journal
   (`kvpilot.tuner.search.reseed`: the nearest earlier workload's best trials first, the running
   settings as the baseline), which may replace the running settings only as the first did
   (beyond the measured noise), with the user's pinned settings never changed;
4. the trigger window's shape is recorded as the workload the new study tuned for (the next
   nearest-workload lookup reads it), and the watcher's reference is rebuilt from the first
   windows after the study (the medians of WatchConfig.reference_windows windows, steadier
   than one window at low rates).
One rollout at a time holds by construction: the session is sequential, and each trial and
each restore waits for its rollout (`KubernetesRunner.wait_rollout`) before the next step.
None of the systems we compare with re-tunes engine limits on a workload move: KServe and
llm-d scale replicas; vLLM's auto_tune and sweep tune once, offline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna

from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.search.reseed import record_shape, shape_of, study_names
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.shape import WorkloadShape
from kvpilot.tuner.watch import WatchConfig, Watcher, WindowVerdict

logger = logging.getLogger("kvpilot.tuner")


class Site(Protocol):
    """Where the engine runs, as the continuous session drives it."""

    def run_study(self, name: str, running: EngineSettings, n_trials: int) -> tuple[optuna.Study, EngineSettings]:
        """Runs (or resumes) study `name` from `running` (seeded from the journal when it is
        not the first) and deploys its outcome; returns the study and the settings now deployed."""
        ...

    def observe(self) -> tuple[Measurement, WorkloadShape]:
        """One watch window of the live traffic (WatchConfig.window_s long)."""
        ...

    def publish(self, status: dict[str, Any]) -> None:
        """status.tuning's fields (a cluster) or a progress line (local)."""
        ...

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        """A Kubernetes Event on the resource (a cluster) or a line on stderr (local)."""
        ...


@dataclass(frozen=True)
class ContinuousConfig:
    """watch: the watcher's windows and guard rails; first_trials / retune_trials: the trial
    budgets of the first study and of each study the watcher starts; max_windows: stop after
    this many watch windows (benchmarks, tests; None: until stop())."""

    watch: WatchConfig = field(default_factory=WatchConfig)
    first_trials: int = 8
    retune_trials: int = 6
    max_windows: int | None = None


@dataclass
class Timeline:
    """What the session saw and did, in order: one entry per watch window and per study
    (JSON-able; the benchmark and the report read it). Times in seconds since the epoch."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    def window(self, number: int, m: Measurement, shape: WorkloadShape, v: WindowVerdict, study: str) -> dict:
        """Appends and returns watch window `number`'s entry: the watcher's verdict (attainment, windows
        breached / shifted, trigger), the shape, completed requests, p95 TTFT and ITL (s; None when NaN)."""
        entry = {"kind": "window", "window": number, "time_s": time.time(), "study": study,
                 "attainment": _finite(v.attainment), "violations": v.violations,
                 "breached_windows": v.breached_windows, "shifted_windows": v.shifted_windows,
                 "shift": {k: list(pair) for k, pair in v.shift.items()}, "held": v.held,
                 "trigger": v.trigger.reason if v.trigger else None, "shape": shape.as_dict(),
                 "completed": m.completed, "ttft_p95_s": _finite(m.ttft_p95_s), "itl_p95_s": _finite(m.itl_p95_s),
                 "preemptions": m.preemptions}
        self.entries.append(entry)
        return entry

    def study(self, name: str, reason: str, message: str, settings: EngineSettings, trials: int) -> None:
        """Appends study `name`'s entry: why it ran (Initial, Resumed, SLOBreached, WorkloadShifted), the
        settings it left deployed and its number of trials."""
        self.entries.append({"kind": "study", "study": name, "time_s": time.time(), "reason": reason,
                             "message": message, "deployed": settings.as_dict(), "trials": trials})


def _finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def run_continuous(site: Site, storage: optuna.storages.BaseStorage, base_name: str, running: EngineSettings,
                   slo: SLO, config: ContinuousConfig, metrics: Any = None,
                   stop: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic,
                   on_window: Callable[[dict[str, Any]], None] | None = None,
                   timeline: Timeline | None = None) -> Timeline:
    """Runs the session until stop() (checked between windows and before each study) or
    config.max_windows windows; returns its Timeline (`timeline`, filled as it goes, when
    given: the caller keeps it if the session is interrupted). metrics: a
    kvpilot.api.tuning_metrics.TunerMetrics (or None). Raises what site.run_study raises
    (e.g. TuningStopped: the study resumes with the next session, from the same journal)."""
    timeline = timeline if timeline is not None else Timeline()
    names = study_names(storage, base_name) or [base_name]
    name = names[-1]  # a restarted session resumes the last study, then watches
    first = len(names) == 1
    _set_watching(metrics, False)
    study, running = site.run_study(name, running, config.first_trials if first else config.retune_trials)
    timeline.study(name, "Initial" if first else "Resumed", "", running, len(study.trials))
    watcher = Watcher(slo, config.watch, reference=None, clock=clock)
    watcher.study_ended(None)
    tuned_on_recorded = shape_of(study) is not None
    windows = 0
    while not stop() and (config.max_windows is None or windows < config.max_windows):
        _set_watching(metrics, True)
        m, shape = site.observe()
        windows += 1
        verdict = watcher.observe(m, shape)
        if not tuned_on_recorded and shape.requests >= config.watch.min_requests:
            record_shape(study, shape)  # the first study's workload: the traffic it settled on
            tuned_on_recorded = True
        entry = timeline.window(windows, m, shape, verdict, name)
        if metrics is not None:
            metrics.record_window(verdict.attainment, verdict.breached_windows, shape.as_dict())
        site.publish({"phase": "Watching", "watch": {k: entry[k] for k in (
            "attainment", "breached_windows", "shifted_windows", "violations", "shape", "held")}})
        if on_window is not None:
            on_window(entry)
        if verdict.trigger is None or stop():
            continue
        trigger = verdict.trigger
        number = len(study_names(storage, base_name))
        name = f"{base_name}-{number}"
        site.event(trigger.reason, trigger.message, warning=True)
        if metrics is not None:
            metrics.record_retune(trigger.reason)
        _set_watching(metrics, False)
        site.publish({"phase": "Running", "study": number,
                      "trigger": {"reason": trigger.reason, "message": trigger.message[:1000],
                                  "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
        watcher.study_started()
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                    directions=[d.name.lower() for d in study.directions])
        record_shape(study, shape)  # what the new study tunes for (the nearest-workload lookup reads it)
        study, running = site.run_study(name, running, config.retune_trials)
        timeline.study(name, trigger.reason, trigger.message, running, len(study.trials))
        watcher.study_ended(None)
        watcher.rebuild_reference()  # from the traffic the new settings serve
    _set_watching(metrics, False)
    return timeline


MAX_WINDOW_GROWTH = 10  # a watch window grows to at most this many times window_s


def watch_window(source: Any, slo: SLO, window_s: float, min_requests: int,
                 stop: Callable[[], bool] = lambda: False) -> tuple[Measurement, WorkloadShape]:
    """One watch window from `source` (ScrapeSource or PrometheusSource): window_s long, and
    longer, by whole window_s, until it holds min_requests finished (or failed) requests, up to
    MAX_WINDOW_GROWTH times window_s. An overloaded engine finishes few requests: a fixed window
    would then judge nothing while its queue grows (seen with vLLM at 2 requests at once and
    545 waiting); a grown one judges them. stop() ends the wait early."""
    start = source.begin()
    for _ in range(MAX_WINDOW_GROWTH):
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline and not stop():
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        m, shape = source.observe_window(start, slo)
        if m.completed + m.failed >= min_requests or stop():
            break
    return m, shape


def _set_watching(metrics: Any, watching: bool) -> None:
    if metrics is not None:
        metrics.set_watching(watching)
