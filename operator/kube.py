"""A small async Kubernetes REST client over aiohttp, for the operator's own API calls.

Kopf logs in and watches by itself but has no general client; the generated `kubernetes`
client is synchronous and model-typed. The handlers only need get/create/patch/delete of
plain dict manifests, so this is that, with credentials read by kubernetes.config.
"""
from __future__ import annotations

import ssl
from typing import Any

import aiohttp

MERGE_PATCH = "application/merge-patch+json"

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
           "PodMonitor": "podmonitors", "Secret": "secrets", "NetworkPolicy": "networkpolicies"}


class ApiError(Exception):
    """A failed API call: HTTP status, the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                subresource: str | None = None) -> str:
    """/api/v1/namespaces/ns/services/name or /apis/group/version/..."""
    root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [root] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    parts += [p for p in (name, subresource) if p]
    return "/".join(parts)


def manifest_path(obj: dict[str, Any], with_name: bool = True) -> str:
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"),
                       meta["name"] if with_name else None)


class Kube:
    """Plain-dict CRUD against one API server. One aiohttp session, opened on first use."""

    def __init__(self, host: str, token: str | None = None, ssl_context: ssl.SSLContext | bool = True):
        self.host = host.rstrip("/")
        # A User-Agent of its own, so that audit logs (and the RBAC-coverage test) tell its requests apart.
        self._headers = {"User-Agent": "kvpilot-operator", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls) -> "Kube":
        """Credentials as kubectl finds them: in-cluster service account, else KUBECONFIG."""
        import kubernetes.client
        import kubernetes.config

        cfg = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=cfg)
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        token = header.split(" ", 1)[-1] if header else None
        context: ssl.SSLContext | bool = True
        if cfg.host.startswith("https"):
            context = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.verify_ssl else False
            if context and cfg.cert_file:
                context.load_cert_chain(cfg.cert_file, cfg.key_file)
        return cls(cfg.host, token, context)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=30))
        kwargs: dict[str, Any] = {"ssl": self._ssl, "params": params}
        if body is not None:
            kwargs["json"] = body
            kwargs["headers"] = {"Content-Type": content_type}
        async with self._session.request(method, self.host + path, **kwargs) as resp:
            data = await resp.json(content_type=None) if resp.content_length != 0 else None
            if resp.status >= 400:
                data = data if isinstance(data, dict) else {}
                raise ApiError(resp.status, data.get("reason", resp.reason or ""), data.get("message", ""))
            return data

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", manifest_path(obj, with_name=False), obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    async def delete(self, path: str, propagation: str = "Background") -> bool:
        """True when deleted, False when it was already gone."""
        try:
            await self.request("DELETE", path, {"kind": "DeleteOptions", "apiVersion": "v1",
                                                "propagationPolicy": propagation})
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    async def has_resource(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves group/version/plural (e.g. a CRD is installed)."""
        found = await self.get(f"/apis/{group}/{version}")
        return bool(found) and any(r.get("name") == plural for r in found.get("resources", ()))
