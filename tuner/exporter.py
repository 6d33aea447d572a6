"""The tuner's own Prometheus metrics, which the kvpilot dashboard charts:
`kvpilot_tuner_trial` (the trial number now running or last finished) and
`kvpilot_tuner_best_objective` (the best feasible objective value so far), both labelled by
`namespace` and `inferenceservice` (a local run uses namespace "local")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server


class TunerMetrics:
    def __init__(self, namespace: str, name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"namespace": namespace, "inferenceservice": name}
        self.trial = Gauge("kvpilot_tuner_trial", "The tuner's current trial number.",
                           list(labels), registry=self.registry).labels(**labels)
        self.best = Gauge("kvpilot_tuner_best_objective", "The best feasible objective value found so far.",
                          list(labels), registry=self.registry).labels(**labels)
        self.trials_total = Gauge("kvpilot_tuner_trials", "Trials finished, by verdict.",
                                  [*labels, "verdict"], registry=self.registry)
        self._labels = labels

    def record(self, number: int, verdict: str, best: float | None) -> None:
        self.trial.set(number)
        self.trials_total.labels(**self._labels, verdict=verdict).inc()
        if best is not None:
            self.best.set(best)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Exposes the metrics at http://addr:port/metrics (a background thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
