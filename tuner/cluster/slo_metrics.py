"""Exports every InferenceService's spec.slo as kvpilot_slo_* gauges (kvpilot.api.tuning_metrics,
the operator process's metrics registry), so that the dashboard draws SLO lines whether or
not the resource is being tuned. An event handler: it keeps no state on the resource.

Registered by `kvpilot operator --metrics-port PORT` (or `kopf run -m kvpilot.tuner.cluster.slo_metrics`);
served with `--metrics-port` / KVPILOT_METRICS_PORT."""
from __future__ import annotations

from typing import Any

import kopf

from kvpilot.api.crd import GROUP, PLURAL, VERSION
from kvpilot.api.spec import SLOSpec
from kvpilot.api.tuning_metrics import TunerMetrics


def export_slo(event_type: str | None, namespace: str, name: str, spec: dict[str, Any]) -> None:
    """Sets (or, for DELETED, removes) the resource's kvpilot_slo_* series; a spec.slo that
    is not numbers is left to validation (the series keep their last good values)."""
    metrics = TunerMetrics(namespace, name)
    if event_type == "DELETED":
        metrics.forget_slo()
        return
    try:
        known = {k: float(v) for k, v in (spec.get("slo") or {}).items() if k in SLOSpec.__dataclass_fields__}
    except (TypeError, ValueError):
        return
    metrics.set_spec_slo(SLOSpec(**known))


@kopf.on.event(GROUP, VERSION, PLURAL)
def slo_changed(type: str | None, namespace: str, name: str, spec: kopf.Spec, **_: Any) -> None:
    """Kopf event handler (kopf.on.event: every watch event, no progress kept on the resource):
    exports the resource's spec.slo (export_slo)."""
    export_slo(type, namespace, name, dict(spec))
