"""Fixtures for the operator tests: this module's namespace on the session's real control
plane (tests/conftest.py), kubectl against it, the chart installed with `helm install`, and
the real operator (`kvpilot.cli.operator`, i.e. `kopf run` of our handlers) as a subprocess
with the chart's command line and the chart's ServiceAccount's credentials."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from kube.cluster import Cluster
from kube.release import Release
from kube.tools import Kubectl, Operator


@pytest.fixture(scope="module")
def kubectl(cluster: Cluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[Release]:
    """The chart, installed in this module's namespace (its crds/ bring the CRD)."""
    installed = Release(cluster, f"kv-{cluster.namespace}").install()
    yield installed
    installed.uninstall()


@pytest.fixture(scope="module")
def crd_installed(release: Release) -> None:
    """The CRD comes with the chart."""


@pytest.fixture(scope="module")
def operator(cluster: Cluster, release: Release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    workdir = tmp_path_factory.mktemp("operator")
    running = Operator(release.operator_kubeconfig(workdir / "kubeconfig"), workdir / "operator.log",
                       cluster.namespace, release.name)
    running.start()
    yield running
    running.stop()
