"""A small synchronous Kubernetes client for the tuner: get and merge-patch an
InferenceService and its status subresource. Credentials as kubectl finds them (in-cluster
service account, else KUBECONFIG), loaded by the `kubernetes` package as the operator does;
the calls themselves are plain httpx."""

from __future__ import annotations

from typing import Any

import httpx

from kvpilot.api.crd import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class KubeClient:
    def __init__(self, host: str, token: str | None = None, verify: Any = True, cert: Any = None):
        headers = {"User-Agent": "kvpilot-tuner", **({"Authorization": f"Bearer {token}"} if token else {})}
        self.http = httpx.Client(base_url=host.rstrip("/"), headers=headers, verify=verify, cert=cert, timeout=30)

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> KubeClient:
        import kubernetes.client
        import kubernetes.config

        cfg = kubernetes.client.Configuration()
        try:
            if kubeconfig:
                raise kubernetes.config.ConfigException("a kubeconfig was given")
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        token = header.split(" ", 1)[-1] if header else None
        verify: Any = (cfg.ssl_ca_cert or True) if cfg.verify_ssl else False
        cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file else None
        return cls(cfg.host, token, verify, cert)

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One API call; PATCH is a JSON merge patch. Raises KubeError on an error status."""
        return self._call(method, path, body)

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"Content-Type": MERGE_PATCH} if method == "PATCH" else {}
        resp = self.http.request(method, path, json=body, headers=headers)
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(resp.status_code, message)
        return resp.json()

    @staticmethod
    def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        return f"{path}/{subresource}" if subresource else path

    def get_isvc(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call("GET", self.isvc_path(namespace, name))

    def patch_isvc(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge patch of the resource (spec); raises KubeError (e.g. 422 when a CRD rule refuses it)."""
        return self._call("PATCH", self.isvc_path(namespace, name), patch)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge patch of the status subresource: only the given keys change."""
        return self._call("PATCH", self.isvc_path(namespace, name, "status"), {"status": status})
