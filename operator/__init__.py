"""The kvpilot Kubernetes operator: InferenceService -> Deployment + Service + ConfigMap.

Pure parts (validation, engine_args, builders, status) need no cluster; the spec types
and the CRD's identity come from `kvpilot.api`; handlers.py wires them into Kopf, kube.py
talks to the API server; `kvpilot.cli.operator` runs it all (with the tuner's daemon when
asked). Nothing here imports `kvpilot.tuner`.
"""
