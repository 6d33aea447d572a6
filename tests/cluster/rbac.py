"""Maps API requests to RBAC (verb, group, resource, subresource) and checks them against the
rules of rendered Roles/ClusterRoles.

Source: Kubernetes docs, "Authorization" > "Determine the request verb": GET on one object is
get, on a collection list, with ?watch=true watch; POST create; PUT update; PATCH patch;
DELETE delete, on a collection deletecollection. Subresources are matched as
"resource/subresource". Namespaced requests are allowed by a Role in that namespace or a
ClusterRole (bound cluster-wide); cluster-scoped ones only by a ClusterRole.
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from cluster.paths import parse_api_path


@dataclass(frozen=True, order=True)
class Access:
    verb: str
    group: str
    resource: str  # "plural" or "plural/subresource"
    namespace: str | None

    def __str__(self) -> str:
        return f"{self.verb} {self.group or 'core'}/{self.resource}" + (f" in {self.namespace}" if self.namespace else "")


def access_of(method: str, path_qs: str) -> Access | None:
    """The RBAC access a request needs; None for discovery and non-resource paths."""
    url = urllib.parse.urlsplit(path_qs)
    path = parse_api_path(url.path)
    if path is None:
        return None
    query = urllib.parse.parse_qs(url.query)
    if method == "GET":
        verb = "watch" if query.get("watch", [""])[0] in ("true", "1") else ("get" if path.name else "list")
    elif method == "DELETE":
        verb = "delete" if path.name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}[method]
    resource = path.plural + (f"/{path.subresource}" if path.subresource else "")
    return Access(verb, path.group, resource, path.namespace)


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
