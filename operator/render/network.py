"""The NetworkPolicy the operator puts in front of each InferenceService's engine pods: only
the engine port, and only from pods in the same namespace, from Prometheus and from the
operator (which runs the tuner). Everything else in the cluster is refused, so the control
routes and the API are not open to every pod. The chart turns it off with
`networkPolicy.enabled: false`. It takes effect only where the network plugin enforces
NetworkPolicies; tests/images/test_network_policies.py checks it on the tests' real node, where
kube-network-policies does.

Source: Kubernetes NetworkPolicy (networking.k8s.io/v1): a pod selected by any policy with
policyTypes [Ingress] admits only what some `ingress` rule allows; `from` peers are ORed, a
peer with both namespaceSelector and podSelector needs both.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.spec import InferenceServiceSpec

from kvpilot.operator.render.builders import child_object, selector_labels
from kvpilot.engine.settings.env import (
    KVPILOT_NETWORK_POLICY, KVPILOT_OPERATOR_LABELS, KVPILOT_OPERATOR_NAMESPACE, KVPILOT_PROMETHEUS_PEER,
)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """enabled: create one per InferenceService. operator_namespace/operator_labels: where the
    operator's pods run and how they are labelled. prometheus: the NetworkPolicyPeer that
    matches Prometheus (default: pods labelled app.kubernetes.io/name=prometheus, any namespace)."""

    enabled: bool = True
    operator_namespace: str = ""
    operator_labels: Mapping[str, str] = field(default_factory=lambda: {"app.kubernetes.io/component": "operator",
                                                                       "app.kubernetes.io/name": "kvpilot"})
    prometheus: Mapping[str, Any] = field(default_factory=lambda: {
        "namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}})

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "NetworkPolicyConfig":
        """KVPILOT_NETWORK_POLICY (true/false), KVPILOT_OPERATOR_NAMESPACE,
        KVPILOT_OPERATOR_LABELS and KVPILOT_PROMETHEUS_PEER (JSON). Raises ValueError on bad JSON."""
        default = cls()
        return cls(
            enabled=env.get(KVPILOT_NETWORK_POLICY, "true").lower() not in ("false", "0", "no"),
            operator_namespace=env.get(KVPILOT_OPERATOR_NAMESPACE, ""),
            operator_labels=json.loads(env[KVPILOT_OPERATOR_LABELS]) if env.get(KVPILOT_OPERATOR_LABELS)
            else default.operator_labels,
            prometheus=json.loads(env[KVPILOT_PROMETHEUS_PEER]) if env.get(KVPILOT_PROMETHEUS_PEER)
            else default.prometheus,
        )


def build_networkpolicy(name: str, namespace: str, spec: InferenceServiceSpec,
                        config: NetworkPolicyConfig) -> dict[str, Any]:
    """Ingress to the engine port of this InferenceService's pods from the namespace,
    Prometheus and the operator; with parallelism.nnodes > 1 also every port between the
    InferenceService's own pods (its groups' rendezvous and collectives); nothing else."""
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(config.operator_labels)}}
    if config.operator_namespace and config.operator_namespace != namespace:
        operator["namespaceSelector"] = {"matchLabels": {NAMESPACE_NAME_LABEL: config.operator_namespace}}
    peers = [{"podSelector": {}}, dict(config.prometheus), operator]
    ingress: list[dict[str, Any]] = [{"from": peers, "ports": [{"protocol": "TCP", "port": spec.engine.port}]}]
    if spec.nnodes > 1:
        # a group's pods meet on node 0's rendezvous port and then on ephemeral ports (gloo's
        # pairs, NCCL's sockets): every port, but only from the pods of this InferenceService
        ingress.append({"from": [{"podSelector": {"matchLabels": selector_labels(name)}}]})
    return child_object("networking.k8s.io/v1", "NetworkPolicy", name, namespace, spec, spec={
        "podSelector": {"matchLabels": selector_labels(name)},
        "policyTypes": ["Ingress"],
        "ingress": ingress,
    })
