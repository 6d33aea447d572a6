"""The emulated API server's object store: what etcd and the registry do for every write.

Every write goes through `_commit`, which keeps uid, creationTimestamp and the immutable
metadata, separates status from the rest (for types with a status subresource), applies the
CRD schema, bumps metadata.generation on spec changes, skips no-op writes, assigns a new
resourceVersion and hands the event to watchers and controllers. Deletion honours
finalizers, and the garbage collector follows ownerReferences.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import copy
import datetime
import random
import string
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .gc import GarbageCollection
from .names import label_errors, name_errors
from .quantity import canonicalize
from .resources import ResourceType, builtin_types, types_from_crd

Obj = dict[str, Any]
Listener = Callable[[str, ResourceType, Obj, Obj | None], None]


class ApiError(Exception):
    """An error the API server answers with a Status object."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> Obj:
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": self.code, "reason": self.reason, "message": self.message, "details": self.details}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rtype.qualified} "{name}" not found',
                    {"name": name, "group": rtype.group, "kind": rtype.plural})


@dataclass
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    rtype: ResourceType
    obj: Obj
    old: Obj | None


@dataclass(eq=False)
class Watcher:
    rtype: ResourceType
    namespace: str | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class Store(GarbageCollection):
    """Objects by (group, plural, namespace, name); one resourceVersion counter for all."""

    def __init__(self, history: int = 20000):
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.objects: dict[tuple[tuple[str, str], str, str], Obj] = {}
        self.rv = 0
        self.log: collections.deque[Event] = collections.deque(maxlen=history)
        self.watchers: set[Watcher] = set()
        self.listeners: list[Listener] = []
        for rtype in builtin_types():
            self.register(rtype)
        for ns in ("default", "kube-system", "kube-public"):
            self.create(self.type_of("", "v1", "namespaces"), None, {"metadata": {"name": ns}})

    # -- types --
    def register(self, rtype: ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def type_of(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def _crd_changed(self, crd: Obj, deleted: bool) -> None:
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for key in [k for k in self.types if k[0] == group and k[2] == plural]:
            del self.types[key]
        if not deleted:
            for rtype in types_from_crd(crd):
                self.register(rtype)
            crd.setdefault("status", {})["conditions"] = [
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": now()}]
            crd["status"]["acceptedNames"] = crd["spec"]["names"]

    # -- reads --
    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self.objects.get((rtype.key, namespace or "", name))
        if obj is None:
            raise not_found(rtype, name)
        return self._view(rtype, obj)

    def list(self, rtype: ResourceType, namespace: str | None,
             predicate: Callable[[Obj], bool] = lambda o: True) -> tuple[list[Obj], int]:
        items = [self._view(rtype, obj) for (key, ns, _), obj in sorted(self.objects.items(), key=lambda kv: kv[0])
                 if key == rtype.key and (namespace is None or ns == namespace) and predicate(obj)]
        return items, self.rv

    def _view(self, rtype: ResourceType, obj: Obj) -> Obj:
        """A copy of the object as read through rtype's version."""
        view = copy.deepcopy(obj)
        view["apiVersion"], view["kind"] = rtype.api_version, rtype.kind
        return view

    # -- writes --
    def create(self, rtype: ResourceType, namespace: str | None, body: Obj) -> Obj:
        body = copy.deepcopy(body)
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{rtype.kind} is invalid: metadata.name: Required value: name or generateName is required")
        if rtype.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request")
            namespace = namespace or meta.get("namespace") or "default"
            if (("", "namespaces"), "", namespace) not in self.objects:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                               {"name": namespace, "kind": "namespaces"})
            meta["namespace"] = namespace
        else:
            namespace = ""
            meta.pop("namespace", None)
        key = (rtype.key, namespace or "", name)
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{rtype.qualified} "{name}" already exists',
                           {"name": name, "group": rtype.group, "kind": rtype.plural})
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now())
        for drop in ("resourceVersion", "deletionTimestamp", "generation"):
            meta.pop(drop, None)
        if rtype.has_generation:
            meta["generation"] = 1
        if rtype.kind == "Namespace":
            body["status"] = {"phase": "Active"}
        elif rtype.status_subresource and rtype.group not in ("", "apps"):
            body.pop("status", None)  # a custom resource's status is written through /status only
        return self._commit(rtype, key, None, body)

    def replace(self, rtype: ResourceType, namespace: str | None, name: str, body: Obj,
                subresource: str | None = None) -> Obj:
        """PUT: the whole object, guarded by metadata.resourceVersion when the body has one."""
        key = (rtype.key, namespace or "", name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(rtype, name)
        sent_rv = (body.get("metadata") or {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rtype.qualified} "{name}": '
                           "the object has been modified; please apply your changes to the latest version and try again",
                           {"name": name, "group": rtype.group, "kind": rtype.plural})
        return self._commit(rtype, key, old, copy.deepcopy(body), subresource)

    def patch(self, rtype: ResourceType, namespace: str | None, name: str,
              apply: Callable[[Obj], Obj], subresource: str | None = None) -> Obj:
        key = (rtype.key, namespace or "", name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(rtype, name)
        new = apply(copy.deepcopy(old))
        sent_rv = (new.get("metadata") or {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rtype.qualified} "{name}": '
                           "the object has been modified", {"name": name, "kind": rtype.plural})
        return self._commit(rtype, key, old, new, subresource)

    def _commit(self, rtype: ResourceType, key: Any, old: Obj | None, new: Obj,
                subresource: str | None = None) -> Obj:
        if old is not None:
            if subresource == "status":
                new = {**copy.deepcopy(old), "status": new.get("status")}
            elif rtype.status_subresource and subresource is None:
                new["status"] = copy.deepcopy(old.get("status"))
            if new.get("status") is None:
                new.pop("status", None)
            meta = new.setdefault("metadata", {})
            for keep in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp", "generation"):
                if keep in old["metadata"]:
                    meta[keep] = old["metadata"][keep]
                else:
                    meta.pop(keep, None)
            if subresource == "status":
                new["metadata"] = copy.deepcopy(old["metadata"])
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        if rtype.builtin and rtype.kind == "Secret":
            _secret_write(new)
        self._validate_meta(rtype, new, creating=old is None)
        if rtype.schema is not None:
            new, causes = rtype.schema.admit(new)
            if causes:
                name = new["metadata"]["name"]
                text = causes[0].render() if len(causes) == 1 else "[" + ", ".join(c.render() for c in causes) + "]"
                raise ApiError(422, "Invalid", f'{rtype.kind}.{rtype.group} "{name}" is invalid: {text}',
                               {"name": name, "group": rtype.group, "kind": rtype.kind,
                                "causes": [{"reason": c.reason, "message": c.message, "field": c.field}
                                           for c in causes]})
        if old is not None:
            if rtype.has_generation and _spec_of(new) != _spec_of(old):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            if new == old:
                return self._view(rtype, old)  # a no-op write keeps the resourceVersion
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                return self._remove(rtype, key, old)
        if rtype.kind == "CustomResourceDefinition":
            self._crd_changed(new, deleted=False)
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[key] = new
        self._emit("ADDED" if old is None else "MODIFIED", rtype, new, old)
        if old is None and new["metadata"].get("ownerReferences"):
            self._later(self._collect_orphan, rtype, key)
        return self._view(rtype, new)

    @staticmethod
    def _validate_meta(rtype: ResourceType, obj: Obj, creating: bool) -> None:
        """What the API server checks on every object (label keys and values) and on built-in
        kinds (the name's format, quantities, which it also rewrites in canonical form)."""
        meta, name = obj["metadata"], obj["metadata"].get("name", "")
        causes = [("metadata.labels", f'Invalid value: "{v}": {m}') for v, m in label_errors(meta.get("labels"))]
        template = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
        causes += [("spec.template.metadata.labels", f'Invalid value: "{v}": {m}')
                   for v, m in label_errors(template.get("labels"))]
        if rtype.builtin:
            if creating:
                causes += [("metadata.name", f'Invalid value: "{name}": {m}') for m in name_errors(rtype.kind, name)]
            causes += canonicalize(rtype.kind, obj)
        if causes:
            text = ", ".join(f"{f}: {m}" for f, m in causes)
            raise ApiError(422, "Invalid", f'{rtype.kind} "{name}" is invalid: {"[" + text + "]" if len(causes) > 1 else text}',
                           {"name": name, "group": rtype.group, "kind": rtype.kind,
                            "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes]})

    def delete(self, rtype: ResourceType, namespace: str | None, name: str,
               propagation: str = "Background", preconditions: dict[str, str] | None = None) -> Obj:
        key = (rtype.key, namespace or "", name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(rtype, name)
        if preconditions and preconditions.get("uid") and preconditions["uid"] != old["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                           f"UID in object meta: {old['metadata']['uid']}")
        if old["metadata"].get("finalizers") or propagation == "Foreground" and self._dependents(old):
            if old["metadata"].get("deletionTimestamp"):
                return self._view(rtype, old)
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            if propagation == "Foreground" and not old["metadata"].get("finalizers"):
                new["metadata"]["finalizers"] = ["foregroundDeletion"]
                self._later(self._foreground, rtype, key)
            self.rv += 1
            new["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[key] = new
            self._emit("MODIFIED", rtype, new, old)
            return self._view(rtype, new)
        removed = self._remove(rtype, key, old)
        if propagation == "Orphan":
            self._orphan(old["metadata"]["uid"])
        return removed

    def _remove(self, rtype: ResourceType, key: Any, old: Obj) -> Obj:
        del self.objects[key]
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._emit("DELETED", rtype, gone, old)
        if rtype.kind == "CustomResourceDefinition":
            self._crd_changed(old, deleted=True)
        if rtype.kind == "Namespace":
            for other in [k for k in self.objects if k[1] == key[2]]:
                self._delete_key(other)
        self._later(self._collect, old["metadata"]["uid"])
        return self._view(rtype, gone)

    # -- events --
    def _emit(self, kind: str, rtype: ResourceType, obj: Obj, old: Obj | None) -> None:
        event = Event(self.rv, kind, rtype, copy.deepcopy(obj), old)
        self.log.append(event)
        for watcher in list(self.watchers):
            if watcher.rtype.key == rtype.key and watcher.namespace in (None, obj["metadata"].get("namespace", "")):
                watcher.queue.put_nowait(event)
        for listener in self.listeners:
            listener(kind, rtype, obj, old)

    def events_since(self, rtype: ResourceType, rv: int) -> Iterable[Event] | None:
        """Logged events of rtype after rv; None when rv is older than the log (410 Gone)."""
        if self.log and rv < self.log[0].rv - 1:
            return None
        return [e for e in self.log if e.rv > rv and e.rtype.key == rtype.key]


def _spec_of(obj: Obj) -> Obj:
    """What bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _secret_write(secret: Obj) -> None:
    """What the API server does to a Secret on every write (core/v1 Secret reference):
    `stringData` is merged into `data` (base64), overwriting keys of the same name, and is
    never stored or read back; an empty `type` defaults to Opaque."""
    plain = secret.pop("stringData", None) or {}
    if plain:
        data = secret.setdefault("data", {}) or {}
        data.update({k: base64.b64encode(str(v).encode()).decode() for k, v in plain.items()})
        secret["data"] = data
    if not secret.get("type"):
        secret["type"] = "Opaque"

