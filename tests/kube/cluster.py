"""One test module's view of the session's control plane: its own namespace (created fresh,
deleted at the end), a kubeconfig whose context defaults to it, and reads of the objects in
it, so that test modules sharing one API server never see each other's objects."""
from __future__ import annotations

import contextlib
import json
import pathlib
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import yaml

from .controlplane import ControlPlane, kubeconfig


def namespace_for(module_name: str) -> str:
    """A DNS-1123 label from a test module's name: test_operator_e2e -> operator-e2e."""
    name = re.sub(r"[^a-z0-9-]+", "-", module_name.lower().removeprefix("test_")).strip("-")
    return name[:63].rstrip("-") or "test"


class Cluster:
    """`cluster.kubeconfig` (the admin, defaulting to `cluster.namespace`), `cluster.objects()`."""

    __test__ = False

    def __init__(self, control_plane: ControlPlane, namespace: str, workdir: pathlib.Path):
        self.control_plane, self.namespace = control_plane, namespace
        self.url = control_plane.url
        self.kubeconfig = workdir / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig(control_plane.url, control_plane.ca,
                                                             control_plane.admin, namespace)))
        self.kubeconfig.chmod(0o600)

    def __enter__(self) -> Cluster:
        self.control_plane.api("POST", "/api/v1/namespaces",
                               {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        return self

    def __exit__(self, *exc: object) -> None:
        self.control_plane.api("DELETE", f"/api/v1/namespaces/{self.namespace}")

    def service_account_kubeconfig(self, service_account: str, path: pathlib.Path) -> pathlib.Path:
        """A kubeconfig that authenticates as this namespace's service account, with a token
        from the TokenRequest API (what the kubelet mounts into the operator's pod)."""
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": 4 * 3600}}
        answer = json.loads(self.control_plane.api(
            "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{service_account}/token", request))
        path.write_text(yaml.safe_dump(kubeconfig(self.control_plane.url, self.control_plane.ca,
                                                  answer["status"]["token"], self.namespace)))
        path.chmod(0o600)
        return path

    def requests(self, username: str | None = None) -> list[dict[str, Any]]:
        """The audit events of the requests `username` sent (everyone's when None)."""
        return [e for e in self.control_plane.audit_events()
                if username is None or e["user"]["username"] == username]

    def objects(self, group: str, version: str, plural: str, namespace: str | None = "",
                labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The objects of a kind in `namespace` (this module's by default; None: all
        namespaces), with these labels, as the API server lists them."""
        namespace = self.namespace if namespace == "" else namespace
        root = f"/api/{version}" if not group else f"/apis/{group}/{version}"
        path = f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"
        if labels:
            path += "?" + urllib.parse.urlencode({"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())})
        return json.loads(self.control_plane.api("GET", path))["items"]


@contextlib.contextmanager
def standalone(workdir: pathlib.Path, namespace: str, audit: bool = False, **control_plane: Any) -> Iterator[Cluster]:
    """A control plane of its own with one namespace, for a benchmark run outside pytest."""
    (workdir / "controlplane").mkdir(parents=True, exist_ok=True)
    with ControlPlane(workdir / "controlplane", audit=audit, **control_plane) as plane, \
            Cluster(plane, namespace, workdir) as cluster:
        yield cluster
