"""The operator's own Prometheus metrics, on the operator's metrics port (`kvpilot operator
--metrics-port`, the chart's `metrics.port`), beside the tuner's kvpilot_slo_* and
kvpilot_tuning_* families. Labels `namespace` and `inferenceservice`, as the tuner's.

    kvpilot_operator_reconcile_duration_seconds   histogram by handler (create, update, resume,
                                                  resync, deployment, drift, group): one
                                                  reconcile's wall time
    kvpilot_operator_reconciles_total             by handler and result (success, retry, failed, error)
    kvpilot_operator_inferenceservice_condition   1 on the condition's current status, 0 on the
                                                  others (status true/false/unknown), as
                                                  kube-state-metrics writes kube_*_status_condition
    kvpilot_operator_rollout_age_seconds          since the rollout in progress began (Progressing
                                                  True, reason RollingOut); 0 when none runs
    kvpilot_operator_tuning_phase                 1 on status.tuning.phase (Idle, Running, Done, Failed)
    kvpilot_operator_tuning_trial                 status.tuning.trial, the trial the tuner runs now
    kvpilot_operator_is_leader                    1 on the replica that holds the lease and reconciles

The per-resource families come from the watch (every event carries the status the operator
and the tuner wrote), so only the leader has them; a standby shows is_leader 0 and nothing else.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
LABELS = ["namespace", "inferenceservice"]
STATUSES = ("true", "false", "unknown")
TUNING_PHASES = ("Idle", "Running", "Done", "Failed")
# from a no-op resync (a few GETs, ~10 ms) to a slow API server under a 1,000-resource apply
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

RECONCILE_SECONDS = Histogram("kvpilot_operator_reconcile_duration_seconds",
                              "Wall time of one reconcile of an InferenceService, by handler.", ["handler"],
                              buckets=BUCKETS, registry=REGISTRY)
RECONCILES = Counter("kvpilot_operator_reconciles", "Reconciles by handler and result (success, retry: "
                     "kopf.TemporaryError, failed: the spec cannot run, error: anything else).",
                     ["handler", "result"], registry=REGISTRY)
CONDITION = Gauge("kvpilot_operator_inferenceservice_condition", "1 on each status condition's current status "
                  "(true, false, unknown), 0 on the others.", [*LABELS, "condition", "status"], registry=REGISTRY)
ROLLOUT_AGE = Gauge("kvpilot_operator_rollout_age_seconds", "Seconds since the rollout in progress began "
                    "(Progressing True, RollingOut); 0 when none runs.", LABELS, registry=REGISTRY)
TUNING_PHASE = Gauge("kvpilot_operator_tuning_phase", "1 on status.tuning.phase, 0 on the other phases.",
                     [*LABELS, "phase"], registry=REGISTRY)
TUNING_TRIAL = Gauge("kvpilot_operator_tuning_trial", "status.tuning.trial: the trial the tuner runs now.",
                     LABELS, registry=REGISTRY)
IS_LEADER = Gauge("kvpilot_operator_is_leader", "1 while this replica holds the leader-election lease and "
                  "reconciles, else 0.", ["lease"], registry=REGISTRY)

_lock = threading.Lock()
_conditions: dict[tuple[str, str], set[str]] = {}  # (namespace, name) -> condition types with series
_rollouts: dict[tuple[str, str], float] = {}  # (namespace, name) -> when its rollout began (epoch s)
_tuned: dict[tuple[str, str], set[str]] = {}  # (namespace, name) -> tuning phases with series


@contextlib.contextmanager
def reconcile_timer(handler: str) -> Iterator[None]:
    """Times the block into the histogram and counts its result."""
    start, result = time.perf_counter(), "error"
    try:
        yield
        result = "success"
    except kopf.TemporaryError:
        result = "retry"
        raise
    except kopf.PermanentError:
        result = "failed"
        raise
    finally:
        RECONCILE_SECONDS.labels(handler).observe(time.perf_counter() - start)
        RECONCILES.labels(handler, result).inc()


def _epoch(stamp: str | None) -> float | None:
    try:
        return datetime.datetime.strptime(stamp or "", "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.timezone.utc).timestamp()
    except ValueError:
        return None


def _rollout_age(key: tuple[str, str]) -> float:
    started = _rollouts.get(key)
    return max(0.0, time.time() - started) if started is not None else 0.0


def observe(namespace: str, name: str, body: Mapping[str, Any] | None) -> None:
    """Sets one InferenceService's series from its status as the watch delivered it; None
    (the resource was deleted) removes them."""
    key = (namespace, name)
    with _lock:
        if body is None:
            _forget(key)
            return
        status = body.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or () if c.get("type")}
        for gone in _conditions.get(key, set()) - set(conditions):
            for s in STATUSES:
                _remove(CONDITION, namespace, name, gone, s)
        for type_, cond in conditions.items():
            current = str(cond.get("status", "Unknown")).lower()
            for s in STATUSES:
                CONDITION.labels(namespace, name, type_, s).set(1.0 if s == current else 0.0)
        _conditions[key] = set(conditions)

        progressing = conditions.get("Progressing") or {}
        rolling = progressing.get("status") == "True" and progressing.get("reason") == "RollingOut"
        started = _epoch(progressing.get("lastTransitionTime")) if rolling else None
        if started is not None:
            _rollouts[key] = started
        else:
            _rollouts.pop(key, None)
        ROLLOUT_AGE.labels(namespace, name).set_function(lambda: _rollout_age(key))

        tuning = status.get("tuning") or {}
        if tuning.get("phase"):
            phases = {*TUNING_PHASES, str(tuning["phase"])}
            for phase in phases:
                TUNING_PHASE.labels(namespace, name, phase).set(1.0 if phase == tuning["phase"] else 0.0)
            for phase in _tuned.get(key, set()) - phases:
                _remove(TUNING_PHASE, namespace, name, phase)
            if tuning.get("trial") is not None:
                TUNING_TRIAL.labels(namespace, name).set(float(tuning["trial"]))
            _tuned[key] = phases
        elif key in _tuned:
            _forget_tuning(key)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


def _forget_tuning(key: tuple[str, str]) -> None:
    for phase in _tuned.pop(key, set()):
        _remove(TUNING_PHASE, *key, phase)
    _remove(TUNING_TRIAL, *key)


def _forget(key: tuple[str, str]) -> None:
    for type_ in _conditions.pop(key, set()):
        for s in STATUSES:
            _remove(CONDITION, *key, type_, s)
    _rollouts.pop(key, None)
    _remove(ROLLOUT_AGE, *key)
    _forget_tuning(key)


def set_leader(lease: str, leader: bool) -> None:
    """Sets kvpilot_operator_is_leader{lease} to 1 while this replica leads (lease "" without election), else 0."""
    IS_LEADER.labels(lease).set(1.0 if leader else 0.0)


class Collector:
    """This registry's families, for a registry served elsewhere (the operator process serves
    one port for its own and the tuner's metrics: `registry.register(Collector())`)."""

    def collect(self) -> Iterator[Any]:
        """Every metric family of the operator's REGISTRY (prometheus_client's custom-collector protocol)."""
        yield from REGISTRY.collect()

    def describe(self) -> list[Any]:
        """No families up front ([]): prometheus_client then neither calls collect() nor checks names at register."""
        return []
