"""The chart installed for real: `helm install` (Helm 4, server-side apply) into a test
module's namespace, and the operator run as the chart's service account, so that the API
server enforces the chart's RBAC on every request the operator sends."""
from __future__ import annotations

import pathlib
import subprocess

from .cluster import Cluster
from .tools import ROOT, tool


class Release:
    """`helm install RELEASE charts/kvpilot` in the cluster's namespace, watching it."""

    def __init__(self, cluster: Cluster, name: str, *sets: str):
        self.cluster, self.name, self.sets = cluster, name, sets
        self.service_account = name if "kvpilot" in name else f"{name}-kvpilot"  # kvpilot.fullname

    def helm(self, *args: str) -> subprocess.CompletedProcess:
        env = {"KUBECONFIG": str(self.cluster.kubeconfig), "HOME": str(self.cluster.kubeconfig.parent),
               "PATH": "/usr/bin:/bin"}
        result = subprocess.run([tool("helm"), *args, "--namespace", self.cluster.namespace], env=env,
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {result.stderr}")
        return result

    def install(self) -> Release:
        self.helm("install", self.name, str(ROOT / "charts" / "kvpilot"),
                  f"--set=watch.namespaces={{{self.cluster.namespace}}}", *self.sets)
        return self

    def uninstall(self) -> None:
        self.helm("uninstall", self.name, "--wait")

    def operator_kubeconfig(self, path: pathlib.Path) -> pathlib.Path:
        """Credentials of the chart's ServiceAccount (what its pod would mount)."""
        return self.cluster.service_account_kubeconfig(self.service_account, path)

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.cluster.namespace}:{self.service_account}"
