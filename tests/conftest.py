"""Session-wide fixtures: the real Kubernetes control plane (issue 31) that every test
talking to a cluster shares, each test module in a namespace of its own (kwok nodes); podman
and the images `make images` builds, built once per session into podman's storage under
~/.cache/kvpilot-images (KVPILOT_IMAGES_DIR), so that reruns reuse the base image and the cached
layers; and a second cluster whose one node is real and runs those images as pods (`node`)."""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from kube.cluster import Cluster, namespace_for  # noqa: E402
from kube.controlplane import ControlPlane  # noqa: E402
from kube.node import Node, bridge, describe, machine_lock  # noqa: E402
from kube.node import install as install_node  # noqa: E402
from kube.podman import VERSION, podman  # noqa: E402
from kube.tools import ROOT  # noqa: E402


def to_test_log(pytestconfig: pytest.Config, line: str) -> None:
    """Writes line into pytest's own output (the `make test` log), past output capturing."""
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        if reporter is not None:
            reporter.write_line("\n" + line)
        else:
            print(line, file=sys.stderr)


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
        to_test_log(pytestconfig, line)
        yield running


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """This test module's namespace on the session's control plane."""
    name = namespace_for(request.module.__name__.rsplit(".", 1)[-1])
    with Cluster(control_plane, name, tmp_path_factory.mktemp(name)) as view:
        yield view


@pytest.fixture(scope="session")
def container_engine() -> str:
    """Installs podman where missing; skips (with the reason) only where it cannot be installed."""
    install = subprocess.run(["bash", str(ROOT / "images" / "install-podman.sh")], capture_output=True,
                             text=True, timeout=900)
    if shutil.which("podman") is None:
        pytest.skip(f"no container engine: podman could not be installed here ({install.stderr.strip()[-500:]})")
    assert install.returncode == 0, install.stderr
    return "podman"


@pytest.fixture(scope="session")
def images(container_engine: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`make images`' default targets, built (or found up to date in the layer cache): target -> tag."""
    log = tmp_path_factory.mktemp("images") / "build.log"
    with log.open("w") as out:
        result = subprocess.run(["make", "-C", str(ROOT), "images"], stdout=out, stderr=subprocess.STDOUT,
                                timeout=3000)
    assert result.returncode == 0, f"make images failed:\n{log.read_text()[-6000:]}"
    tags = {t: f"kvpilot/{t}:{VERSION}" for t in ("engine-cpu", "engine-vllm-cpu", "operator")}
    for tag in tags.values():
        podman("image", "exists", tag)
    return tags


@pytest.fixture(scope="session")
def node(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
         pytestconfig: pytest.Config) -> Iterator[ControlPlane]:
    """A control plane of its own with one real node (tests/kube/node.py: the kubelet, kube-proxy,
    containerd, runc, a CNI bridge) whose containerd holds the images `make images` built, under
    the names the chart gives them (kvpilot/TARGET:VERSION, i.e. docker.io/kvpilot/...). The API
    server listens on the node's bridge address, where the pods reach it. One per machine at a
    time; skips only where the node cannot run (not root)."""
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (network namespaces, cgroups, mounts)")
    install_node()
    workdir = tmp_path_factory.mktemp("node")
    names = {f"localhost/{tag}": (f"docker.io/{tag}",) for tag in images.values()}
    start = time.monotonic()
    with machine_lock(), bridge() as address, \
            ControlPlane(workdir / "controlplane", kwok=False, audit=True, address=address) as control_plane, \
            Node(control_plane, workdir / "node", names) as running:
        line = (f"{describe(running.node())}; API server {control_plane.version['gitVersion']} at "
                f"{control_plane.url}; images imported: {', '.join(running.imported) or 'none (up to date)'}; "
                f"ready in {time.monotonic() - start:.0f} s; logs in {workdir}")
        to_test_log(pytestconfig, line)
        yield control_plane
