"""kvpilot's API: what the operator, the tuner and the benchmarks share about an
InferenceService, and nothing else (they import this, not each other).

    crd.py     the custom resource's identity (group, version, plural, kind)
    spec.py    spec as frozen dataclasses with the CRD's defaults
    models.py  shapes of the builtin models (builtin://NAME)
    kube.py    the one Kubernetes client (the official `kubernetes` package) and its ApiError
    tuning_metrics.py  the kvpilot_slo_* and kvpilot_tuning_* series the dashboard charts

Torch-free, no engine and no Kopf; crd, spec and models need no third-party package,
tuning_metrics needs prometheus_client.
"""
