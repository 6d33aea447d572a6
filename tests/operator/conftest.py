"""Fixtures for the operator tests: the emulated cluster, kubectl against it, and the real
operator (`kvpilot.cli.operator`, i.e. `kopf run` of our handlers) as a subprocess."""
from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cluster.harness import TestCluster  # noqa: E402
from cluster.tools import ROOT, Kubectl, Operator  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    with TestCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def kubectl(cluster: TestCluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


@pytest.fixture(scope="module")
def crd_installed(kubectl: Kubectl) -> None:
    kubectl.apply(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml")


@pytest.fixture(scope="module")
def operator(cluster: TestCluster, crd_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    running = Operator(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log")
    running.start()
    yield running
    running.stop()
