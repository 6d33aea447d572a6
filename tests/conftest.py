"""Session-wide fixtures: the real Kubernetes control plane (issue 31) that every test
talking to a cluster shares, each test module in a namespace of its own."""
from __future__ import annotations

import pathlib
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from kube.cluster import Cluster, namespace_for  # noqa: E402
from kube.controlplane import ControlPlane  # noqa: E402


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory,
                  pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and a kwok node, built
    by `make controlplane` when missing; stopped, every process, at the end of the session.
    The API server's /version goes to the test log."""
    with ControlPlane(tmp_path_factory.mktemp("controlplane"), audit=True) as running:
        version = running.version
        line = (f"kube-apiserver {version['gitVersion']} ({version['platform']}, {version['goVersion']}) "
                f"at {running.url}, logs in {running.workdir}")
        reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n" + line)
        print(line, file=sys.stderr)
        yield running


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """This test module's namespace on the session's control plane."""
    name = namespace_for(request.module.__name__.rsplit(".", 1)[-1])
    with Cluster(control_plane, name, tmp_path_factory.mktemp(name)) as view:
        yield view
