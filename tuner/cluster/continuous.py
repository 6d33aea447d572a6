"""Continuous tuning of an InferenceService (spec.tuning.mode continuous): the cluster's
`kvpilot.tuner.continuous.Site`. Studies run as in one-shot mode (`ClusterStudies.run_study`:
each trial patched into spec.engine and rolled out by the operator, one at a time), but end
in phase Watching instead of Done, so the tuner daemon (`kvpilot.tuner.cluster.daemon`) keeps
running; the watch windows are read from the same source as the trials (Prometheus scoped
to the resource's pods, or the engine's /metrics), and every window goes into
status.tuning.watch and the tuner's metrics.

When the watcher starts a study it posts a Warning Event (reason SLOBreached or
WorkloadShifted, the figures in the message) and sets the resource's `Tuning` condition
(status True, the same reason and message; status False, reason Watching, once the study
has deployed its outcome). The condition is written with the object's resourceVersion
(optimistic concurrency, retried on 409), so the operator's own conditions, written by
another process, are never lost; the operator may still write back an older Tuning condition
from the object its handler was given, so every watch window checks it and sets it again when it
differs from what the tuner last set. Sources: Kubernetes API conventions, "Typical status
properties" (conditions) and "Concurrency Control and Consistency".

The session ends when stop() turns true (the operator shuts down), or when the resource no
longer asks for continuous tuning (mode once, or tuning off): both are checked between
windows and before each trial.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import optuna

from kvpilot.api.kube import ApiError, isvc_path
from kvpilot.tuner.continuous import ContinuousConfig, run_continuous, watch_window
from kvpilot.tuner.search.objective import Measurement
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.shape import WorkloadShape
from kvpilot.tuner.watch import SLO_BREACHED, WORKLOAD_SHIFTED, WatchConfig

logger = logging.getLogger("kvpilot.tuner")
CONDITION = "Tuning"


def set_condition(kube: Any, namespace: str, name: str, status: str, reason: str, message: str,
                  retries: int = 10) -> None:
    """Sets the resource's `Tuning` condition (lastTransitionTime moves only when the status
    does), keeping every other condition; a merge patch carrying the resourceVersion read, so
    a concurrent writer makes it fail with 409 and it is read and written again. Logs (never
    raises) when it cannot."""
    for _ in range(retries):
        obj = kube.get_isvc(namespace, name)
        conditions = list((obj.get("status") or {}).get("conditions") or [])
        old = next((c for c in conditions if c.get("type") == CONDITION), None)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        new = {"type": CONDITION, "status": status, "reason": reason, "message": message[:1000],
               "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status else now,
               "observedGeneration": obj["metadata"].get("generation")}
        conditions = [c for c in conditions if c.get("type") != CONDITION] + [new]
        body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                "status": {"conditions": conditions}}
        try:
            kube.patch(isvc_path(namespace, name, "status"), body)
            return
        except ApiError as e:
            if e.status != 409:
                logger.warning("could not set the %s condition: %s", CONDITION, e)
                return
    logger.warning("could not set the %s condition: %d conflicts", CONDITION, retries)


class ClusterSite:
    """The continuous session's Site for one InferenceService (see the module doc).
    studies: a kvpilot.tuner.cluster.session.ClusterStudies."""

    def __init__(self, studies: Any, stop: Callable[[], bool]):
        self.studies, self.stop = studies, stop
        self.window_s = float(studies.spec.tuning.watchSeconds)
        self.condition: tuple[str, str, str] | None = None  # (status, reason, message) last set

    def set_condition(self, status: str, reason: str, message: str) -> None:
        """Sets the resource's `Tuning` condition (module set_condition; message cut to 1,000
        characters) and remembers it for keep_condition."""
        a = self.studies.a
        self.condition = (status, reason, message[:1000])
        set_condition(self.studies.kube, a.namespace, a.name, status, reason, message)

    def keep_condition(self) -> None:
        """Sets the Tuning condition again when it no longer reads as last set: the operator
        patches the conditions from the object its handler was given, which may predate the
        tuner's last write."""
        if self.condition is None:
            return
        a = self.studies.a
        try:
            conditions = (self.studies.kube.get_isvc(a.namespace, a.name).get("status") or {}).get("conditions")
        except ApiError as e:
            logger.warning("could not read the %s condition: %s", CONDITION, e)
            return
        now = next((c for c in conditions or () if c.get("type") == CONDITION), {})
        if (now.get("status"), now.get("reason"), now.get("message")) != self.condition:
            self.set_condition(*self.condition)

    def run_study(self, name: str, running: EngineSettings, n_trials: int) -> tuple[optuna.Study, EngineSettings]:
        """Site.run_study through ClusterStudies (ending in phase Watching), then the condition
        False/Watching. Raises TuningStopped when stop() turns true."""
        _, final, study = self.studies.run_study(name, running, n_trials, self.stop, final_phase="Watching")
        self.set_condition("False", "Watching", f"study {name} deployed {final.describe()}; watching the live "
                                                f"traffic every {self.window_s:.0f} s")
        return study, final

    def observe(self) -> tuple[Measurement, WorkloadShape]:
        """One watch window (spec.tuning.watchSeconds, grown until WatchConfig.min_requests) from the
        trials' source: Prometheus scoped to the resource's pods, or the engine's /metrics."""
        return watch_window(self.studies.measurer.source_for(self.studies.target), self.studies.slo, self.window_s,
                            WatchConfig().min_requests, self.stop)

    def publish(self, status: dict[str, Any]) -> None:
        """Writes `status` into status.tuning, then re-sets the Tuning condition if the operator
        wrote back an older one."""
        self.studies.runner.write_tuning(**status)
        self.keep_condition()

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        """Posts a Kubernetes Event on the resource (type Warning or Normal); a trigger (SLOBreached,
        WorkloadShifted) also sets the Tuning condition True with the same reason and message."""
        self.studies.event(reason, message, "Warning" if warning else "Normal")
        if reason in (SLO_BREACHED, WORKLOAD_SHIFTED):
            self.set_condition("True", reason, message)


def still_continuous(kube: Any, namespace: str, name: str) -> bool:
    """Whether the resource still asks for continuous tuning (it may have been edited)."""
    try:
        tuning = (kube.get_isvc(namespace, name).get("spec") or {}).get("tuning") or {}
    except ApiError as e:
        return e.status != 404
    return bool(tuning.get("enabled")) and tuning.get("mode") == "continuous"


def run_watching(studies: Any, original: EngineSettings, stop: Callable[[], bool]) -> dict[str, Any]:
    """Runs the continuous session for `studies` (ClusterStudies) from the settings in
    spec.engine; returns {"timeline": [...]} when it ends."""
    a, tuning = studies.a, studies.spec.tuning
    checked = {"at": 0.0, "still": True}

    def ended() -> bool:  # the resource is read at most every 5 s
        if time.monotonic() - checked["at"] > 5.0:
            checked.update(at=time.monotonic(), still=still_continuous(studies.kube, a.namespace, a.name))
        return stop() or not checked["still"]

    watch = WatchConfig(window_s=float(tuning.watchSeconds), breach_windows=tuning.breachWindows,
                        shift_ratio=float(tuning.shiftRatio), cooldown_s=float(tuning.cooldownSeconds),
                        max_studies_per_hour=tuning.maxStudiesPerHour)
    config = ContinuousConfig(watch=watch, first_trials=a.trials or tuning.maxTrials, retune_trials=tuning.retuneTrials)
    timeline = run_continuous(ClusterSite(studies, ended), studies.storage, studies.base_name, original,
                              studies.slo, config, studies.metrics, stop=ended)
    return {"timeline": timeline.entries}
