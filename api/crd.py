"""The InferenceService custom resource's identity, as in crds/inferenceservices.kvpilot.dev.yaml
(group, version, plural, kind; the API path is /apis/GROUP/VERSION/namespaces/NS/PLURAL)."""
from __future__ import annotations

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
API_VERSION = f"{GROUP}/{VERSION}"
