"""kvpilot's API: what the operator and the tuner share about an InferenceService, and
nothing else (neither imports the other; both import this).

    crd.py     the custom resource's identity (group, version, plural, kind)
    spec.py    spec as frozen dataclasses with the CRD's defaults
    models.py  shapes of the builtin models (builtin://NAME)
    kube.py    the one Kubernetes client (the official `kubernetes` package) and its ApiError

Torch-free, no engine and no Kopf; crd, spec and models need no third-party package.
"""
