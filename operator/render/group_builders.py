"""Pure builders of a multi-pod InferenceService (spec.parallelism.nnodes > 1): each replica is a
group of nnodes pods that run one engine, laid out as a LeaderWorkerSet lays out a group.

- One leader StatefulSet named NAME with spec.replicas pods NAME-0 .. NAME-(R-1): pod NAME-i is
  node 0 of group i (`--node-rank 0`), serves the HTTP API and metrics, and carries the probes.
- One worker StatefulSet per group, NAME-i, with nnodes-1 pods NAME-i-1 .. NAME-i-(nnodes-1)
  (`ordinals.start: 1`), so a worker's rank is its StatefulSet ordinal, read from the pod label
  `apps.kubernetes.io/pod-index` through the downward API and passed as `--node-rank
  $(LWS_WORKER_INDEX)` (the kubelet expands `$(VAR)` in args). Workers run `--headless` (vLLM
  needs it on every node but 0; kvpilot implies it) and have no HTTP port and no probes.
- One headless Service NAME-group (publishNotReadyAddresses: node 0 must resolve before it is
  Ready, since it becomes Ready only once every node joined) gives every pod a DNS name; the
  master address of group i is NAME-i.NAME-group.NAMESPACE.svc.
- The client Service (builders.build_service) selects the leaders only.

Both StatefulSets use podManagementPolicy Parallel (a group's pods start together: node 0 waits
for the others, so OrderedReady would never start them) and updateStrategy OnDelete: the
operator replaces a whole group at once (operator/groups.py), as LWS does.

Two StatefulSets per group rather than one, because node 0 and the others need different pod
templates (probes and the HTTP port on node 0 only, `--headless` on the others for upstream
vLLM); this is LWS's leaderTemplate / workerTemplate split, with the same names, so the same
group maps onto a LeaderWorkerSet one to one (docs/guide.md).

Sources: LeaderWorkerSet v0.10 (leaderworkerset.x-k8s.io/v1: LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX, pod names NAME-i and NAME-i-j); Kubernetes StatefulSet (serviceName,
podManagementPolicy, updateStrategy OnDelete, ordinals.start, the pod-index label); vLLM's
multi-node serving without Ray (`--nnodes --node-rank --master-addr --master-port --headless`).
"""
from __future__ import annotations

import copy
from typing import Any

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.engine.settings import BY_NAME, to_flags

from kvpilot.operator.render.builders import (HASH_ANNOTATION, ROLE_LABEL, Images, build_configmap, build_pod_template, child_object,
                       selector_labels, serving_labels)
from kvpilot.operator.render.engine_args import config_hash

GROUP_LABEL = "kvpilot.dev/group-index"    # on workers: the group (replica) they belong to
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (Kubernetes >= 1.28)
MASTER_PORT = 29501                        # vLLM's default --master-port: node 0's rendezvous store
RENDEZVOUS_PORT_NAME = "rendezvous"


def headless_service_name(name: str) -> str:
    """The headless Service that gives every group pod a DNS name (NAME-group)."""
    return f"{name}-group"


def worker_statefulset_name(name: str, group: int) -> str:
    """Group `group`'s worker StatefulSet (NAME-i; its pods are NAME-i-1 .. NAME-i-(nnodes-1))."""
    return f"{name}-{group}"


def leader_pod_name(name: str, group: int) -> str:
    """Node 0 of group `group`: ordinal i of the leader StatefulSet NAME (NAME-i, as LWS names it)."""
    return f"{name}-{group}"


def leader_address(name: str, namespace: str, group: int) -> str:
    """Node 0's DNS name in group `group`: its pod name under the headless Service."""
    return f"{leader_pod_name(name, group)}.{headless_service_name(name)}.{namespace}.svc"


def worker_labels(name: str, group: int) -> dict[str, str]:
    """A worker pod's labels: the selector ones, role worker and its group index (groups.group_index)."""
    return {**selector_labels(name), ROLE_LABEL: "worker", GROUP_LABEL: str(group)}


def group_hash(name: str, namespace: str, spec: InferenceServiceSpec, images: Images = Images()) -> str:
    """The configuration every pod of every group runs (the leader template before its group
    variables, the ConfigMap, nnodes); a change replaces the groups."""
    return config_hash({"template": build_pod_template(name, spec, images), "nnodes": spec.nnodes,
                        "config": build_configmap(name, namespace, spec)["data"]})


def _multinode_args(spec: InferenceServiceSpec, rank: str) -> list[str]:
    """vLLM's multi-node flags, spelled by the settings table (a string rank: `$(VAR)`)."""
    return to_flags({"nnodes": spec.nnodes, "node_rank": rank, "master_addr": "$(LWS_LEADER_ADDRESS)",
                     "master_port": MASTER_PORT})


def _group_template(name: str, spec: InferenceServiceSpec, images: Images, digest: str,
                    labels: dict[str, str], env: list[dict[str, Any]], rank: str) -> dict[str, Any]:
    """The engine pod template with the group's labels, env (the LWS variables, in order: the
    kubelet expands `$(VAR)` only from variables defined before) and the multi-node flags."""
    template = build_pod_template(name, spec, images)
    template["metadata"]["labels"].update(labels)
    template["metadata"]["annotations"][HASH_ANNOTATION] = digest
    container = template["spec"]["containers"][0]
    container["env"] += env + [{"name": "LWS_GROUP_SIZE", "value": str(spec.nnodes)}]
    container["args"] += _multinode_args(spec, rank)
    return template


def build_leader_statefulset(name: str, namespace: str, spec: InferenceServiceSpec,
                             images: Images = Images()) -> dict[str, Any]:
    """Node 0 of every group: spec.replicas pods NAME-0 .. NAME-(R-1), serving the API."""
    digest = group_hash(name, namespace, spec, images)
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "LWS_LEADER_ADDRESS", "value": f"$(POD_NAME).{headless_service_name(name)}.{namespace}.svc"},
           {"name": "LWS_WORKER_INDEX", "value": "0"}]
    template = _group_template(name, spec, images, digest, serving_labels(name, spec), env, "0")
    template["spec"]["containers"][0]["ports"].append(
        {"name": RENDEZVOUS_PORT_NAME, "containerPort": MASTER_PORT, "protocol": "TCP"})
    return _statefulset(name, namespace, spec, name, spec.replicas, serving_labels(name, spec), template, digest)


def build_worker_statefulset(name: str, namespace: str, spec: InferenceServiceSpec, group: int,
                             images: Images = Images()) -> dict[str, Any]:
    """Nodes 1 .. nnodes-1 of group `group`: pods NAME-group-1 .. NAME-group-(nnodes-1),
    headless, rank = ordinal."""
    digest = group_hash(name, namespace, spec, images)
    labels = worker_labels(name, group)
    env = [{"name": "LWS_LEADER_ADDRESS", "value": leader_address(name, namespace, group)},
           {"name": "LWS_WORKER_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}}]
    template = _group_template(name, spec, images, digest, labels, env, "$(LWS_WORKER_INDEX)")
    container = template["spec"]["containers"][0]
    container["args"].append(BY_NAME["headless"].flag)
    container["ports"] = []  # no HTTP server on nodes > 0
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        container.pop(probe)
    statefulset = _statefulset(name, namespace, spec, worker_statefulset_name(name, group), spec.nnodes - 1,
                               labels, template, digest)
    statefulset["spec"]["ordinals"] = {"start": 1}
    return statefulset


def _statefulset(name: str, namespace: str, spec: InferenceServiceSpec, object_name: str, replicas: int,
                 labels: dict[str, str], template: dict[str, Any], digest: str) -> dict[str, Any]:
    statefulset = child_object("apps/v1", "StatefulSet", name, namespace, spec, object_name=object_name, spec={
        "replicas": replicas,
        "selector": {"matchLabels": copy.deepcopy(labels)},
        "serviceName": headless_service_name(name),
        "podManagementPolicy": "Parallel",
        "updateStrategy": {"type": "OnDelete"},
        "template": template,
    })
    statefulset["metadata"]["labels"].update(labels)
    statefulset["metadata"]["annotations"] = {HASH_ANNOTATION: digest}
    return statefulset


def build_headless_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """DNS names for every pod of every group, Ready or not (publishNotReadyAddresses)."""
    return child_object("v1", "Service", name, namespace, spec, object_name=headless_service_name(name), spec={
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": selector_labels(name),
        "ports": [{"name": RENDEZVOUS_PORT_NAME, "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}],
    })


def build_group_children(name: str, namespace: str, spec: InferenceServiceSpec,
                         images: Images = Images()) -> list[dict[str, Any]]:
    """The headless Service, the leader StatefulSet and one worker StatefulSet per replica."""
    return ([build_headless_service(name, namespace, spec), build_leader_statefulset(name, namespace, spec, images)]
            + [build_worker_statefulset(name, namespace, spec, group, images) for group in range(spec.replicas)])
