"""Fake nodes for tests that need a pod to be scheduled, Running and Ready but no container
in it: kwok (sigs.k8s.io/kwok v0.7.0, built beside the control plane from controlplane/kwok/)
manages every Node that carries its annotation; the pod stages in kwok-stages.yaml make a pod bound to the node
Running and Ready at once, with a pod IP from --cidr (or stuck in ImagePullBackOff for the
tests' broken image). Source: kwok.sigs.k8s.io, "kwok in a cluster" and its Stage API."""
from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING

from .tools import wait_for

if TYPE_CHECKING:
    from .controlplane import ControlPlane

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
NODE_NAME = "kwok-node-0"
# Room for the operator benchmark's 200 InferenceServices and their engine pods, and GPUs for
# the tests whose InferenceServices ask for one (nvidia.com/gpu, as the device plugin reports).
CAPACITY = {"cpu": "1000", "memory": "4Ti", "pods": "1000", "ephemeral-storage": "1Ti", "nvidia.com/gpu": "64"}


def node_manifest(name: str = NODE_NAME) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok"}},
            "status": {"capacity": CAPACITY, "allocatable": CAPACITY}}


def start_kwok(control_plane: ControlPlane) -> None:
    """Starts kwok as its own process and registers one node it manages; returns when the
    node is Ready (kwok writes its status)."""
    stages = pathlib.Path(__file__).with_name("kwok-stages.yaml")
    process = control_plane._run("kwok", f"--kubeconfig={control_plane.kubeconfig}", f"--config={stages}",
                                 f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                                 "--cidr=10.244.0.0/16", "--node-ip=10.244.0.1", "--node-lease-duration-seconds=40",
                                 binary=control_plane.bin_dir / "kwok")
    control_plane.api("POST", "/api/v1/nodes", node_manifest())

    def ready() -> bool:
        process.check()
        node = json.loads(control_plane.get(f"/api/v1/nodes/{NODE_NAME}"))
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True"
    wait_for(ready, 60, what=f"kwok to make {NODE_NAME} Ready")
