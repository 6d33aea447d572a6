"""One Kubernetes client for the operator and the tuner: plain-dict get / create / merge-patch /
replace / delete on API paths, with one error type (`ApiError`, the API's Status).

Built on the official `kubernetes` client (its `ApiClient`: credentials from the in-cluster
service account or a kubeconfig, bearer tokens, TLS, urllib3's connection pool, request
serialization and Status errors); only the paths are ours, so custom resources and core
kinds go through one call without the generated per-kind methods or API discovery.
Why this library: it is the one Kopf's own walkthrough creates children with, and it was
already our dependency for credentials; crate-operator uses its asyncio twin
(`kubernetes_asyncio`), but the tuner is synchronous (one session per thread), so one
synchronous client serves both, and the operator's async handlers call it through
`AsyncKubeClient`, on worker threads, as Kopf runs synchronous handlers. kr8s would add a
dependency tree and resolves kinds through API discovery; pykube-ng is unmaintained.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
from kubernetes.client.exceptions import ApiException

from kvpilot.api.crd import API_VERSION, PLURAL

T = TypeVar("T")

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 30

PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
           "PodMonitor": "podmonitors", "Secret": "secrets", "NetworkPolicy": "networkpolicies", "Event": "events",
           "Lease": "leases", "StatefulSet": "statefulsets", "Pod": "pods"}


class ApiError(Exception):
    """A failed API call: HTTP status, the Status reason (e.g. 'AlreadyExists') and message."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @classmethod
    def from_exception(cls, e: ApiException) -> ApiError:
        """The ApiError of a kubernetes client ApiException: status, reason and message from the
        body's Status object (meta/v1 Status) when it is JSON, else from the exception's own fields."""
        try:
            status = json.loads(e.body or "")
        except ValueError:
            status = None
        status = status if isinstance(status, dict) else {}
        return cls(int(e.status or 0), status.get("reason") or e.reason or "", status.get("message") or e.body or "")


def object_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                subresource: str | None = None) -> str:
    """/api/v1/namespaces/ns/services/name or /apis/group/version/..."""
    root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [root] + ([f"namespaces/{namespace}"] if namespace else []) + [plural]
    parts += [p for p in (name, subresource) if p]
    return "/".join(parts)


def manifest_path(obj: dict[str, Any], with_name: bool = True) -> str:
    """The API path of a manifest (a dict with apiVersion, kind, metadata.name and
    metadata.namespace): the object's, or its collection's with with_name=False (the POST target).
    Kinds come from PLURALS; raises KeyError on another kind."""
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"),
                       meta["name"] if with_name else None)


def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
    """The InferenceService's path (or its status / scale subresource's)."""
    return object_path(API_VERSION, PLURAL, namespace, name, subresource)


def load_configuration(kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """Credentials as kubectl finds them: the given kubeconfig, else the in-cluster service
    account, else KUBECONFIG / ~/.kube/config. Raises kubernetes.config.ConfigException."""
    cfg = kubernetes.client.Configuration()
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            return cfg
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    return cfg


class KubeClient:
    """Plain-dict calls against one API server (synchronous; thread-safe as urllib3's pool is).
    user_agent: tells this client's requests apart in audit logs (and the RBAC-coverage test)."""

    def __init__(self, configuration: kubernetes.client.Configuration, user_agent: str = "kvpilot"):
        self.api = kubernetes.client.ApiClient(configuration)
        self.api.user_agent = user_agent

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, user_agent: str = "kvpilot") -> KubeClient:
        """A client with load_configuration's credentials; raises kubernetes.config.ConfigException
        when no kubeconfig or service account is found."""
        return cls(load_configuration(kubeconfig), user_agent)

    def close(self) -> None:
        """Closes the ApiClient's connection pool (and its thread pool, if it made one)."""
        self.api.close()

    def request(self, method: str, path: str, body: Any = None, content_type: str = JSON,
                params: dict[str, str] | None = None) -> Any:
        """One call; the decoded JSON answer. Raises ApiError on an error status."""
        headers = {"Accept": JSON, **({"Content-Type": content_type} if body is not None else {})}
        call = self.api.param_serialize(method, path, query_params=list((params or {}).items()),
                                        header_params=headers, body=body, auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(*call, _request_timeout=TIMEOUT_S)
            response.read()
            return self.api.response_deserialize(response, {"2XX": "object"}).data
        except ApiException as e:
            raise ApiError.from_exception(e) from None

    def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_objects(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        """The items of a collection (path without a name) that match a label selector (k=v,k2)."""
        return self.request("GET", path, params={"labelSelector": label_selector}).get("items") or []

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST of a manifest to its collection; the created object. Raises ApiError
        (409 AlreadyExists when the name is taken, 422 Invalid when the schema refuses it)."""
        return self.request("POST", manifest_path(obj, with_name=False), obj)

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): only the given keys change, null removes one."""
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    def replace(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT of the whole object; with metadata.resourceVersion set, the API server refuses
        it (409 Conflict) when the object changed since that version was read."""
        return self.request("PUT", path, obj)

    def delete(self, path: str, propagation: str = "Background", grace_period_s: int | None = None) -> bool:
        """True when deleted, False when it was already gone. grace_period_s: the pod's
        termination grace instead of its own terminationGracePeriodSeconds (None: its own)."""
        options = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if grace_period_s is not None:
            options["gracePeriodSeconds"] = grace_period_s
        try:
            self.request("DELETE", path, options)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def has_resource(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves group/version/plural (e.g. a CRD is installed)."""
        found = self.get(f"/apis/{group}/{version}")
        return bool(found) and any(r.get("name") == plural for r in found.get("resources", ()))

    def get_isvc(self, namespace: str, name: str) -> dict[str, Any]:
        """GET of the InferenceService namespace/name (kvpilot.dev custom resource); raises ApiError
        (404 NotFound when it does not exist, unlike get())."""
        return self.request("GET", isvc_path(namespace, name))

    def patch_isvc(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge patch of the resource (spec); raises ApiError (e.g. 422 when a CRD rule refuses it)."""
        return self.patch(isvc_path(namespace, name), patch)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge patch of the status subresource: only the given keys change."""
        return self.patch(isvc_path(namespace, name, "status"), {"status": status})


WORKERS = 32  # the operator's request threads (and urllib3 connections); see AsyncKubeClient


class AsyncKubeClient:
    """KubeClient's calls for asyncio code (the operator's Kopf handlers): each runs on a
    worker thread of this client's own pool (`workers` threads, as many urllib3 connections),
    so the event loop keeps serving watches meanwhile; or on `executor` when given.

    Why a pool of its own: asyncio's default executor has min(32, cores + 4) threads, 6 on
    2 cores, shared with everything else in the process; at 1,000 InferenceServices every
    reconcile queued behind the others' requests there (issue 42's benchmark: `create`
    handlers 30 s or more), and the leader's Lease renewals queued past the renew deadline.
    The requests are waits on the API server, not CPU, so more threads than cores help; the
    Lease client keeps a one-thread executor of its own (cli/operator.py)."""

    def __init__(self, client: KubeClient, executor: concurrent.futures.Executor | None = None,
                 workers: int = WORKERS):
        self.client = client
        self._own = executor is None
        self.executor = executor or concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kube")

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, user_agent: str = "kvpilot",
                         executor: concurrent.futures.Executor | None = None,
                         workers: int = WORKERS) -> AsyncKubeClient:
        """Raises kubernetes.config.ConfigException when no credentials are found."""
        configuration = load_configuration(kubeconfig)
        if executor is None:  # one connection per thread: urllib3 discards any beyond maxsize
            configuration.connection_pool_maxsize = workers
        return cls(KubeClient(configuration, user_agent), executor, workers)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def close(self) -> None:
        """Closes the KubeClient on a worker thread, then shuts down the pool if this client made it."""
        await self._call(self.client.close)
        if self._own:
            self.executor.shutdown(wait=False)

    async def get(self, path: str) -> dict[str, Any] | None:
        """KubeClient.get on a worker thread: GET path; None on 404, ApiError on other errors."""
        return await self._call(self.client.get, path)

    async def list_objects(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        """KubeClient.list_objects on a worker thread: GET path?labelSelector=...; the items."""
        return await self._call(self.client.list_objects, path, label_selector)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """KubeClient.create on a worker thread: POST to the manifest's collection; raises ApiError."""
        return await self._call(self.client.create, obj)

    async def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """KubeClient.patch on a worker thread: PATCH path as a JSON merge patch; raises ApiError."""
        return await self._call(self.client.patch, path, patch)

    async def replace(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """KubeClient.replace on a worker thread: PUT path (409 Conflict on a stale resourceVersion)."""
        return await self._call(self.client.replace, path, obj)

    async def delete(self, path: str, propagation: str = "Background", grace_period_s: int | None = None) -> bool:
        """KubeClient.delete on a worker thread: DELETE path; False when it was already gone (404)."""
        return await self._call(self.client.delete, path, propagation, grace_period_s)

    async def has_resource(self, group: str, version: str, plural: str) -> bool:
        """KubeClient.has_resource on a worker thread: GET /apis/group/version lists plural."""
        return await self._call(self.client.has_resource, group, version, plural)
