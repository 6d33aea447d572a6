"""Stand-ins for kube-controller-manager and the kubelet: Deployment -> ReplicaSet -> Pods,
and Pods that turn Ready after a delay. Enough for an operator to see a rollout happen.

A rollout surges: the new ReplicaSet gets all replicas at once and the old ones are scaled
to zero only when the new pods are Ready, so a Deployment is visibly Progressing first.
Pods whose image ends in ":broken" never become Ready (to exercise Degraded).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import string
from typing import Any

from .resources import ResourceType
from .selectors import match_label_selector
from .store import ApiError, Obj, Store, now


def _owner_ref(owner: Obj) -> dict[str, Any]:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _owned_by(obj: Obj, owner: Obj) -> bool:
    return any(r.get("uid") == owner["metadata"]["uid"] for r in obj["metadata"].get("ownerReferences") or ())


def _pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())


class Controllers:
    def __init__(self, store: Store, pod_ready_seconds: float = 0.2):
        self.store = store
        self.pod_ready_seconds = pod_ready_seconds
        self.deployments = store.type_of("apps", "v1", "deployments")
        self.replicasets = store.type_of("apps", "v1", "replicasets")
        self.pods = store.type_of("", "v1", "pods")
        self._queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        self._pending: set[tuple[str, str, str]] = set()
        store.listeners.append(self._on_event)

    def _enqueue(self, kind: str, namespace: str, name: str) -> None:
        key = (kind, namespace, name)
        if key not in self._pending:
            self._pending.add(key)
            self._queue.put_nowait(key)

    def _on_event(self, event: str, rtype: ResourceType, obj: Obj, old: Obj | None) -> None:
        meta = obj["metadata"]
        if rtype.kind == "Deployment" and rtype.group == "apps":
            self._enqueue("Deployment", meta["namespace"], meta["name"])
        elif rtype.kind in ("ReplicaSet", "Pod"):
            if rtype.kind == "ReplicaSet":
                self._enqueue("ReplicaSet", meta["namespace"], meta["name"])
            if rtype.kind == "Pod" and event == "ADDED":
                asyncio.get_running_loop().call_later(self.pod_ready_seconds, self._start_pod,
                                                      meta["namespace"], meta["name"], meta["uid"])
            for ref in meta.get("ownerReferences") or ():
                if ref.get("kind") in ("Deployment", "ReplicaSet"):
                    self._enqueue(ref["kind"], meta["namespace"], ref["name"])

    async def run(self) -> None:
        while True:
            key = await self._queue.get()
            self._pending.discard(key)
            try:
                if key[0] == "Deployment":
                    self._sync_deployment(key[1], key[2])
                else:
                    self._sync_replicaset(key[1], key[2])
            except ApiError as e:
                if e.code not in (404, 409):
                    raise
                self._enqueue(*key)  # lost a race with a writer: try again
                await asyncio.sleep(0.05)

    # -- kubelet --
    def _start_pod(self, namespace: str, name: str, uid: str) -> None:
        try:
            pod = self.store.get(self.pods, namespace, name)
        except ApiError:
            return
        if pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp"):
            return
        broken = any(c.get("image", "").endswith(":broken") for c in pod["spec"].get("containers") or ())
        ready = "False" if broken else "True"
        status = {"phase": "Running", "podIP": f"10.0.{random.randint(0, 255)}.{random.randint(1, 254)}",
                  "startTime": now(),
                  "conditions": [{"type": t, "status": ready if t in ("Ready", "ContainersReady") else "True",
                                  "lastTransitionTime": now()}
                                 for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                  "containerStatuses": [{"name": c["name"], "image": c.get("image", ""), "ready": not broken,
                                         "restartCount": 0, "started": True}
                                        for c in pod["spec"].get("containers") or ()]}
        self.store.patch(self.pods, namespace, name, lambda o: {**o, "status": status}, "status")

    # -- ReplicaSet controller --
    def _sync_replicaset(self, namespace: str, name: str) -> None:
        try:
            rs = self.store.get(self.replicasets, namespace, name)
        except ApiError:
            return
        if rs["metadata"].get("deletionTimestamp"):
            return
        pods, _ = self.store.list(self.pods, namespace, lambda p: _owned_by(p, rs)
                                  and not p["metadata"].get("deletionTimestamp"))
        want = int(rs["spec"].get("replicas", 1))
        template = rs["spec"]["template"]
        for _ in range(want - len(pods)):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{name}-{suffix}", "namespace": namespace,
                                "labels": dict(template["metadata"].get("labels") or {}),
                                "annotations": dict(template["metadata"].get("annotations") or {}),
                                "ownerReferences": [_owner_ref(rs)]},
                   "spec": json.loads(json.dumps(template["spec"])), "status": {"phase": "Pending"}}
            self.store.create(self.pods, namespace, pod)
        for pod in sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"], reverse=True)[:max(0, len(pods) - want)]:
            self.store.delete(self.pods, namespace, pod["metadata"]["name"])
        pods, _ = self.store.list(self.pods, namespace, lambda p: _owned_by(p, rs)
                                  and not p["metadata"].get("deletionTimestamp"))
        ready = sum(_pod_ready(p) for p in pods)
        status = {"replicas": len(pods), "fullyLabeledReplicas": len(pods), "readyReplicas": ready,
                  "availableReplicas": ready, "observedGeneration": rs["metadata"]["generation"]}
        self.store.patch(self.replicasets, namespace, name, lambda o: {**o, "status": status}, "status")

    # -- Deployment controller --
    def _sync_deployment(self, namespace: str, name: str) -> None:
        try:
            dep = self.store.get(self.deployments, namespace, name)
        except ApiError:
            return
        if dep["metadata"].get("deletionTimestamp"):
            return
        spec = dep["spec"]
        want = int(spec.get("replicas", 1))
        template = json.loads(json.dumps(spec["template"]))
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        template.setdefault("metadata", {}).setdefault("labels", {})["pod-template-hash"] = digest
        owned, _ = self.store.list(self.replicasets, namespace, lambda r: _owned_by(r, dep))
        current = next((r for r in owned if r["metadata"]["name"] == f"{name}-{digest}"), None)
        if current is None:
            if not match_label_selector(spec["selector"], template["metadata"]["labels"]):
                return  # a real API server refuses such a Deployment; nothing to roll out
            selector = json.loads(json.dumps(spec["selector"]))
            selector.setdefault("matchLabels", {})["pod-template-hash"] = digest
            current = self.store.create(self.replicasets, namespace, {
                "apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{name}-{digest}", "namespace": namespace,
                             "labels": template["metadata"]["labels"], "ownerReferences": [_owner_ref(dep)]},
                "spec": {"replicas": want, "selector": selector, "template": template}})
        elif current["spec"].get("replicas") != want:
            current = self.store.patch(self.replicasets, namespace, current["metadata"]["name"],
                                       lambda o: {**o, "spec": {**o["spec"], "replicas": want}})
        new_ready = int((current.get("status") or {}).get("readyReplicas") or 0)
        old = [r for r in owned if r["metadata"]["name"] != current["metadata"]["name"]]
        if new_ready >= want:
            for rs in old:
                if rs["spec"].get("replicas"):
                    self.store.patch(self.replicasets, namespace, rs["metadata"]["name"],
                                     lambda o: {**o, "spec": {**o["spec"], "replicas": 0}})
        every = [current] + old
        total = sum(int((r.get("status") or {}).get("replicas") or 0) for r in every)
        ready = sum(int((r.get("status") or {}).get("readyReplicas") or 0) for r in every)
        updated = int((current.get("status") or {}).get("replicas") or 0)
        complete = updated == want and total == want and ready >= want
        status = {
            "observedGeneration": dep["metadata"]["generation"], "replicas": total, "updatedReplicas": updated,
            "readyReplicas": ready, "availableReplicas": ready, "unavailableReplicas": max(0, want - ready),
            "conditions": [
                {"type": "Available", "status": "True" if ready >= want else "False",
                 "reason": "MinimumReplicasAvailable" if ready >= want else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True",
                 "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"}],
        }
        if (dep.get("status") or {}) != status:
            self.store.patch(self.deployments, namespace, name, lambda o: {**o, "status": status}, "status")
