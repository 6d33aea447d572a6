"""The tuner's own Prometheus metrics, which the kvpilot dashboard charts:
`kvpilot_tuner_trial` (the trial number now running or last finished) and
`kvpilot_tuner_best_objective` (the best feasible objective value so far), both labelled by
`namespace` and `inferenceservice` (a local run uses namespace "local")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, start_http_server


# The operator process's registry (`kvpilot operator --tuner --metrics-port N`): every tuning
# session in that process reports into it, one series per InferenceService.
OPERATOR_REGISTRY = CollectorRegistry()
_gauges: dict[int, tuple[Gauge, Gauge, Gauge]] = {}
_operator_port: list[int] = []


def serve_operator_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Serve OPERATOR_REGISTRY at http://addr:port/metrics (once per process)."""
    if not _operator_port:
        _gauges_of(OPERATOR_REGISTRY)  # the families show (HELP/TYPE) before the first session
        start_http_server(port, addr=addr, registry=OPERATOR_REGISTRY)
        _operator_port.append(port)


def operator_registry() -> CollectorRegistry | None:
    """OPERATOR_REGISTRY when this process serves it, else None (a session's own registry)."""
    return OPERATOR_REGISTRY if _operator_port else None


def _gauges_of(registry: CollectorRegistry) -> tuple[Gauge, Gauge, Gauge]:
    if id(registry) not in _gauges:
        labels = ["namespace", "inferenceservice"]
        _gauges[id(registry)] = (
            Gauge("kvpilot_tuner_trial", "The tuner's current trial number.", labels, registry=registry),
            Gauge("kvpilot_tuner_best_objective", "The best feasible objective value found so far.", labels,
                  registry=registry),
            Gauge("kvpilot_tuner_trials", "Trials finished, by verdict.", [*labels, "verdict"], registry=registry))
    return _gauges[id(registry)]


class TunerMetrics:
    def __init__(self, namespace: str, name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"namespace": namespace, "inferenceservice": name}
        trial, best, trials = _gauges_of(self.registry)
        self.trial, self.best, self.trials_total = trial.labels(**labels), best.labels(**labels), trials
        self._labels = labels

    def record(self, number: int, verdict: str, best: float | None) -> None:
        self.trial.set(number)
        self.trials_total.labels(**self._labels, verdict=verdict).inc()
        if best is not None:
            self.best.set(best)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Exposes the metrics at http://addr:port/metrics (a background thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
