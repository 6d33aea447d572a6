"""The RBAC accesses (verb, group, resource/subresource, namespace) of API requests, read from
the API server's audit log, and a static check of them against rendered Roles/ClusterRoles
(for what a test run does not exercise). The API server itself enforces the chart's RBAC on
the operator's service account in the end-to-end tests; this module names what it used.
Namespaced requests are allowed by a Role in that namespace or a ClusterRole; cluster-scoped
ones only by a ClusterRole. Source: Kubernetes docs, "Authorization" and "Auditing"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Access:
    verb: str
    group: str
    resource: str  # "plural" or "plural/subresource"
    namespace: str | None

    def __str__(self) -> str:
        return f"{self.verb} {self.group or 'core'}/{self.resource}" + (f" in {self.namespace}" if self.namespace else "")


def access_of(event: dict[str, Any]) -> Access | None:
    """The RBAC access an API request needed, from its audit event (the API server's own
    verb and resource); None for discovery and other non-resource requests."""
    ref = event.get("objectRef")
    if not ref or "resource" not in ref:
        return None
    resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return Access(event["verb"], ref.get("apiGroup", ""), resource, ref.get("namespace"))


def _allows(rule: dict[str, Any], access: Access) -> bool:
    return (access.group in rule.get("apiGroups", ()) and access.resource in rule.get("resources", ())
            and access.verb in rule.get("verbs", ()))


def missing(accesses: set[Access], docs: list[dict[str, Any]]) -> list[Access]:
    """The accesses that no rendered Role (in the request's namespace) or ClusterRole grants.
    Wildcards are not honoured: the chart must name every verb and resource."""
    roles = [d for d in docs if d.get("kind") in ("Role", "ClusterRole")]
    found = []
    for access in sorted(accesses):
        if not any(_allows(rule, access) for role in roles for rule in role.get("rules") or ()
                   if role["kind"] == "ClusterRole" or role["metadata"].get("namespace") == access.namespace):
            found.append(access)
    return found
