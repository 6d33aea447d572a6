"""A Kubernetes API server emulator on kmock: kmock serves HTTP, discovery, /version and
error rendering; the store (store.py) gives resources real semantics. Requests for known
resource types are routed here before kmock's own parser, which cannot parse
/api/v1/namespaces; everything else (discovery, /version, reactions) goes to kmock."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp.web
import attrs
import kmock
from typing_extensions import override

from . import protobuf
from .patching import PatchError, apply_patch
from .paths import ApiPath, get_field, parse_api_path, set_field
from .resources import ResourceType
from .selectors import SelectorError, selector_predicate
from .store import ApiError, Event, Store, Watcher
from .tables import TABLE_ACCEPT, to_table


def _json(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(data, status=status)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """An HTTP Kubernetes API over an in-memory Store. `calls` records (method, path, status);
    `requests` records (User-Agent, method, path with query) of every resource request, served
    or not (the RBAC-coverage test maps them to verbs and resources)."""

    store: Store = attrs.field(factory=Store)
    calls: list[tuple[str, str, int]] = attrs.field(factory=list)
    requests: list[tuple[str, str, str]] = attrs.field(factory=list)

    # -- discovery from the store's types (kmock renders the groups and /apis) --
    @override
    def _get_resources(self) -> list[kmock.resource]:
        return [kmock.resource(t.group, t.version, t.plural) for t in self.store.types.values()]

    @override
    async def _serve_version(self, request: kmock.Request) -> Any:
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        found = [t for t in self.store.types.values() if (t.group, t.version) == (group, version)]
        if not found:
            raise kmock.KubernetesResourceNotFoundError()
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        resources: list[dict[str, Any]] = []
        for t in found:
            resources.append({"name": t.plural, "singularName": t.singular, "kind": t.kind, "namespaced": t.namespaced,
                              "verbs": verbs, "shortNames": list(t.shortnames), "categories": list(t.categories)})
            if t.status_subresource:
                resources.append({"name": f"{t.plural}/status", "singularName": "", "kind": t.kind,
                                  "namespaced": t.namespaced, "verbs": ["get", "patch", "update"]})
            if t.scale:
                resources.append({"name": f"{t.plural}/scale", "singularName": "", "kind": "Scale",
                                  "group": "autoscaling", "version": "v1", "namespaced": t.namespaced,
                                  "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": resources}

    # -- routing --
    @override
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = parse_api_path(raw.path)
        if path is not None:
            self.requests.append((raw.headers.get("User-Agent", ""), raw.method, raw.path_qs))
        rtype = path and self.store.type_of(path.group, path.version, path.plural)
        if path is None or rtype is None:
            if path is not None and raw.method != "GET":
                return _json(ApiError(404, "NotFound", "the server could not find the requested resource").status(), 404)
            return await super().__call__(raw)
        try:
            response = await self._serve(raw, path, rtype)
        except ApiError as e:
            response = _json(e.status(), e.code)
        except (PatchError, SelectorError, json.JSONDecodeError) as e:
            response = _json(ApiError(400, "BadRequest", str(e)).status(), 400)
        except Exception as e:  # a bug in the emulator: answer 500 so that tests see it
            response = _json(ApiError(500, "InternalError", f"{type(e).__name__}: {e}").status(), 500)
        self.calls.append((raw.method, raw.path_qs, response.status))
        return response

    async def _serve(self, raw: aiohttp.web.BaseRequest, path: ApiPath, rtype: ResourceType) -> aiohttp.web.StreamResponse:
        method, query, sub = raw.method, raw.query, path.subresource
        if rtype.namespaced != (path.namespace is not None) and not (path.name is None and method == "GET"):
            if rtype.namespaced and method != "POST":
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub not in (None, "status", "scale") or (sub == "status" and not rtype.status_subresource) \
                or (sub == "scale" and not rtype.scale):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        body = await self._body(raw)
        if method == "GET" and path.name is None:
            if query.get("watch") in ("true", "1"):
                return await self._watch(raw, rtype, path.namespace)
            predicate = selector_predicate(query.get("labelSelector"), query.get("fieldSelector"))
            items, rv = self.store.list(rtype, path.namespace, predicate)
            listing = {"apiVersion": rtype.api_version, "kind": f"{rtype.kind}List",
                       "metadata": {"resourceVersion": str(rv)}, "items": items}
            if TABLE_ACCEPT in raw.headers.get("Accept", ""):
                return _json(to_table(rtype, items, str(rv)))
            return _json(listing)
        if method == "POST" and path.name is None:
            return _json(self.store.create(rtype, path.namespace, body or {}), 201)
        if method == "DELETE" and path.name is None:
            predicate = selector_predicate(query.get("labelSelector"), query.get("fieldSelector"))
            items, _ = self.store.list(rtype, path.namespace, predicate)
            for item in items:
                self.store.delete(rtype, path.namespace, item["metadata"]["name"])
            return _json({"apiVersion": "v1", "kind": "Status", "status": "Success", "metadata": {}})
        assert path.name is not None
        if sub == "scale":
            return await self._scale(raw, rtype, path, body)
        if method == "GET":
            obj = self.store.get(rtype, path.namespace, path.name)
            if TABLE_ACCEPT in raw.headers.get("Accept", ""):
                return _json(to_table(rtype, [obj], obj["metadata"]["resourceVersion"]))
            return _json(obj)
        if method == "PUT":
            return _json(self.store.replace(rtype, path.namespace, path.name, body or {}, sub))
        if method == "PATCH":
            content_type = raw.headers.get("Content-Type", "")
            return _json(self.store.patch(rtype, path.namespace, path.name,
                                          lambda obj: apply_patch(content_type, obj, body), sub))
        if method == "DELETE":
            options = body or {}
            propagation = query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            obj = self.store.delete(rtype, path.namespace, path.name, propagation, options.get("preconditions"))
            return _json(obj, 202 if obj["metadata"].get("deletionTimestamp") else 200)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {raw.path}")

    @staticmethod
    async def _body(raw: aiohttp.web.BaseRequest) -> Any:
        """The request's body as JSON. kubectl's typed creates of built-in types send protobuf,
        which a real API server decodes (tests/cluster/protobuf.py: Secret, ConfigMap,
        Namespace); a body in an encoding the server has no codec for is answered 415
        Unsupported Media Type, as a real API server answers a protobuf body for a custom
        resource (API concepts, "Alternate representations of resources")."""
        if not raw.can_read_body:
            return None
        media = raw.headers.get("Content-Type", "application/json").split(";")[0].strip()
        if media == "application/vnd.kubernetes.protobuf":
            try:
                return protobuf.decode(await raw.read())
            except protobuf.UnsupportedBody as e:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                               f"accepted media types include: application/json, application/yaml ({e})") from e
        if media not in ("application/json", "application/merge-patch+json", "application/json-patch+json",
                         "application/strategic-merge-patch+json", "application/apply-patch+yaml"):
            raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                           f"accepted media types include: application/json, application/yaml (got {media})")
        return await raw.json()

    # -- the scale subresource --
    def _scale_view(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        assert rtype.scale is not None
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": get_field(obj, rtype.scale["statusReplicasPath"]) or 0}
        selector = get_field(obj, rtype.scale.get("labelSelectorPath", ".status.selector"))
        if isinstance(selector, dict):  # Deployments keep a LabelSelector object in spec.selector
            selector = ",".join(f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items()))
        if selector:
            status["selector"] = selector
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta},
                "spec": {"replicas": get_field(obj, rtype.scale["specReplicasPath"]) or 0}, "status": status}

    async def _scale(self, raw: aiohttp.web.BaseRequest, rtype: ResourceType, path: ApiPath, body: Any) -> aiohttp.web.Response:
        assert rtype.scale is not None and path.name is not None
        current = self.store.get(rtype, path.namespace, path.name)
        if raw.method == "GET":
            return _json(self._scale_view(rtype, current))
        if raw.method == "PUT":
            scale = body or {}
        elif raw.method == "PATCH":
            scale = apply_patch(raw.headers.get("Content-Type", ""), self._scale_view(rtype, current), body)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{raw.method} is not supported on scale")
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", f'Scale.autoscaling "{path.name}" is invalid: spec.replicas: '
                           f"Invalid value: {replicas!r}: must be greater than or equal to 0")
        sent_rv = (scale.get("metadata") or {}).get("resourceVersion")

        def set_replicas(obj: dict[str, Any]) -> dict[str, Any]:
            set_field(obj, rtype.scale["specReplicasPath"], replicas)  # type: ignore[index]
            if sent_rv:
                obj["metadata"]["resourceVersion"] = sent_rv
            return obj
        updated = self.store.patch(rtype, path.namespace, path.name, set_replicas)
        return _json(self._scale_view(rtype, updated))

    # -- watch --
    async def _watch(self, raw: aiohttp.web.BaseRequest, rtype: ResourceType, namespace: str | None) -> aiohttp.web.StreamResponse:
        query = raw.query
        matches = selector_predicate(query.get("labelSelector"), query.get("fieldSelector"))
        timeout = float(query.get("timeoutSeconds") or 1800)
        watcher = Watcher(rtype, namespace)
        since = query.get("resourceVersion") or ""
        initial_end = query.get("sendInitialEvents") == "true"  # the WatchList protocol (kubectl wait)
        if since not in ("", "0") and not initial_end:
            backlog = self.store.events_since(rtype, int(since))
            if backlog is None:
                raise ApiError(410, "Expired", f"too old resource version: {since} ({self.store.log[0].rv})")
            initial = [e for e in backlog if namespace is None or e.obj["metadata"].get("namespace") == namespace]
        else:
            items, rv = self.store.list(rtype, namespace)
            initial = [Event(rv, "ADDED", rtype, item, None) for item in items]
        self.store.watchers.add(watcher)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        deadline = time.monotonic() + timeout
        try:
            for event in initial:
                await self._send(response, rtype, event, matches)
            if initial_end:
                bookmark = {"apiVersion": rtype.api_version, "kind": rtype.kind, "metadata": {
                    "resourceVersion": str(self.store.rv), "annotations": {"k8s.io/initial-events-end": "true"}}}
                await response.write(json.dumps({"type": "BOOKMARK", "object": bookmark}).encode() + b"\n")
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), timeout=left)
                except asyncio.TimeoutError:
                    break
                await self._send(response, rtype, event, matches)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.watchers.discard(watcher)
        return response

    async def _send(self, response: aiohttp.web.StreamResponse, rtype: ResourceType, event: Event,
                    matches: Any) -> None:
        """Send an event as the watcher sees it: an object that leaves the selection is DELETED
        for it, one that enters is ADDED."""
        now_in = matches(event.obj)
        was_in = event.old is not None and matches(event.old)
        kind = event.type
        if kind == "MODIFIED" and not now_in and was_in:
            kind = "DELETED"
        elif kind == "MODIFIED" and now_in and not was_in:
            kind = "ADDED"
        elif not now_in and not (kind == "DELETED" and was_in):
            return
        obj = {**event.obj, "apiVersion": rtype.api_version, "kind": rtype.kind}
        await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
