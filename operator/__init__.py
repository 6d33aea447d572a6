"""The kvpilot Kubernetes operator: InferenceService -> Deployment + Service + ConfigMap.

Pure parts (spec, validation, engine_args, builders, status) need no cluster; handlers.py
wires them into Kopf, kube.py talks to the API server, cli.py runs it all.
"""
