"""The in-cluster tuner's test stack on the real node (tests/kube/node.py): the chart installed with
the tuner and a real Prometheus scraping one InferenceService's serving pods with a PodMonitor's
labels (PodTargets), as tests/tuner/test_tuner_cluster_e2e.py and tests/images/test_vllm_runtime.py
use it."""
from __future__ import annotations

import base64
import contextlib
import json
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from kvpilot.bench.harness.prometheus import Prometheus

from .cluster import Cluster
from .node import NODE_IP
from .pods import POD_START_TIMEOUT_S, wait_rolled_out
from .release import Release
from .tools import Kubectl


class PodTargets:
    """Prometheus' targets file (file_sd) kept equal to the running pods of this resource, with
    the labels a PodMonitor gives them (namespace, pod, app_kubernetes_io_instance from
    podTargetLabels), polled from the API server every second: Debian's Prometheus 2.42 is built
    without kubernetes_sd_configs ("field kubernetes_sd_configs not found"), so this thread does
    the discovery the Prometheus Operator's config would, and Prometheus scrapes each pod."""

    def __init__(self, control_plane, namespace: str, path: Path, name: str, leaders_only: bool = False):
        self.control_plane, self.namespace, self.path, self.name = control_plane, namespace, path, name
        # groups (nnodes > 1): the PodMonitor selects node 0 of each group, the only pod serving HTTP
        self.selector = f"app.kubernetes.io%2Finstance%3D{name}" + (",kvpilot.dev%2Frole%3Dleader" if leaders_only
                                                                      else "")
        self.path.write_text("[]")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def scrape_config(self) -> dict:
        return {"job_name": "engine", "file_sd_configs": [{"files": [str(self.path)], "refresh_interval": "1s"}]}

    def _run(self) -> None:
        query = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={self.selector}"
        while not self._stop.wait(1.0):
            try:
                pods = json.loads(self.control_plane.get(query))["items"]
            except OSError:
                continue
            targets = [{"targets": [f"{p['status']['podIP']}:8000"],
                        "labels": {"namespace": self.namespace, "pod": p["metadata"]["name"],
                                   "app_kubernetes_io_instance": self.name}}
                       for p in pods if p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP")]
            text = json.dumps(targets)
            if text != self.path.read_text():
                self.path.with_suffix(".tmp").write_text(text)
                self.path.with_suffix(".tmp").replace(self.path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def status_without_key(url: str) -> int | None:
    """The status of GET /v1/models without an API key (None: no answer)."""
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).status_code
    except httpx.TransportError:
        return None


def ready(kubectl, name: str) -> dict | None:
    """The InferenceService once its status is of the current generation and Ready, else None."""
    obj = kubectl.json("get", "isvc", name)
    conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
    fresh = obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
    return obj if fresh and conds.get("Ready") == "True" else None


@contextlib.contextmanager
def tuning_operator(node, tmp_path: Path, tuner_args: list[str], namespace: str, name: str, api_key: str,
                    leaders_only: bool = False) -> Iterator[tuple[Cluster, Kubectl, Release, Prometheus]]:
    """The chart installed in `namespace` (each test its own: a deleted namespace takes a while
    to go), its operator pod running the tuner with `tuner_args` and a real Prometheus (scraping
    the serving pods of InferenceService `name`), and the engine's API key in the Secret
    NAME-api-key; uninstalled at the end."""
    with Cluster(node, namespace, tmp_path) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        targets = PodTargets(node, cluster.namespace, tmp_path / "targets.json", name, leaders_only)
        prometheus = Prometheus(tmp_path, [targets.scrape_config()], address=NODE_IP)
        release = Release(cluster, "kv", f"--set-string=tuner.extraArgs={shlex.join(tuner_args)}",
                          f"--set-string=tuner.prometheusUrl={prometheus.url}")
        try:
            release.install()
            wait_rolled_out(kubectl, release.service_account, POD_START_TIMEOUT_S)  # the chart's full name
            kubectl.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-api-key"},
                                          "data": {"api-key": base64.b64encode(api_key.encode()).decode()}}))
            yield cluster, kubectl, release, prometheus
        finally:
            prometheus.stop()
            targets.stop()
            release.uninstall()


def tuner_pod(kubectl, release: Release) -> str:
    """The chart runs two replicas: the tuner runs in the one holding the Lease (named after the release)."""
    return f"pod/{kubectl.json('get', 'lease', release.service_account)['spec']['holderIdentity']}"
