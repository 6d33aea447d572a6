"""The resource types the emulated API server serves: built-in ones and those of CRDs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schema import CRDVersionSchema


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    scale: dict[str, str] | None = None  # specReplicasPath, statusReplicasPath, labelSelectorPath
    has_generation: bool = False
    schema: CRDVersionSchema | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    builtin: bool = False  # a built-in kind: its names and quantities are validated by the API server

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        """Objects are stored per group and plural, whatever version they are read in."""
        return (self.group, self.plural)

    @property
    def qualified(self) -> str:
        """How error messages name the resource: deployments.apps, configmaps."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def subresources(self) -> list[str]:
        return (["status"] if self.status_subresource else []) + (["scale"] if self.scale else [])


def _t(group: str, version: str, plural: str, kind: str, **kw: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, singular=kind.lower(), builtin=True, **kw)


def builtin_types() -> list[ResourceType]:
    deployment_scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector"}
    return [
        _t("", "v1", "namespaces", "Namespace", namespaced=False, shortnames=("ns",), status_subresource=True),
        _t("", "v1", "pods", "Pod", shortnames=("po",), status_subresource=True),
        _t("", "v1", "services", "Service", shortnames=("svc",), status_subresource=True),
        _t("", "v1", "configmaps", "ConfigMap", shortnames=("cm",)),
        _t("", "v1", "secrets", "Secret"),
        _t("", "v1", "serviceaccounts", "ServiceAccount", shortnames=("sa",)),
        _t("", "v1", "events", "Event", shortnames=("ev",)),
        _t("events.k8s.io", "v1", "events", "Event", shortnames=("ev",)),
        _t("apps", "v1", "deployments", "Deployment", shortnames=("deploy",), status_subresource=True,
           scale=deployment_scale, has_generation=True),
        _t("apps", "v1", "replicasets", "ReplicaSet", shortnames=("rs",), status_subresource=True,
           scale=deployment_scale, has_generation=True),
        _t("coordination.k8s.io", "v1", "leases", "Lease"),
        _t("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", shortnames=("netpol",)),  # issue 17
        _t("rbac.authorization.k8s.io", "v1", "roles", "Role"),
        _t("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
        _t("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
        _t("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
        _t("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
           namespaced=False, shortnames=("crd", "crds"), status_subresource=True, has_generation=True),
    ]


def types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    """One ResourceType per served version of a CustomResourceDefinition."""
    spec, names = crd["spec"], crd["spec"]["names"]
    found = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        found.append(ResourceType(
            group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular", names["kind"].lower()),
            shortnames=tuple(names.get("shortNames") or ()), categories=tuple(names.get("categories") or ()),
            status_subresource="status" in subresources, scale=subresources.get("scale"),
            has_generation=True, schema=CRDVersionSchema(schema) if schema else None,
            printer_columns=list(version.get("additionalPrinterColumns") or ()),
        ))
    return found
