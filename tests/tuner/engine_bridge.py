"""Stands in for the engine containers of the test cluster's pods: the test cluster's node is
a kwok node (tests/kube/nodes.py), which only marks pods Ready, so this runs the command of the Ready pods of the current
rollout as one local `kvpilot serve` on a fixed port, where the tuner's load and Prometheus
reach it (as they would reach the Service). When a new rollout's flags differ only in the
scheduler limits, the running engine is reconfigured live instead of restarted (a shortcut
of this stand-in that keeps the test short; a real rollout starts new pods)."""
from __future__ import annotations

import argparse
import base64
import threading
import time
from pathlib import Path

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.operator.builders import HASH_ANNOTATION, ISVC_LABEL
from kvpilot.tuner.engine_process import EngineProcess, free_port
from kvpilot.tuner.failures import TrialFailed
from kvpilot.tuner.settings import EngineSettings


def pod_engine(args: list[str]) -> tuple[str, EngineSettings, list[str]]:
    """(model, settings, other flags) from a pod's container args."""
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, positional_model=True)
    for flag in ("--port", "--api-key", "--host"):
        parser.add_argument(flag)
    ns, _ = parser.parse_known_args(args)
    settings = EngineSettings(**{k: getattr(ns, k) for k in EngineSettings.__dataclass_fields__})
    other = ["--dtype", ns.dtype, "--seed", str(ns.seed)]
    if ns.num_gpu_blocks_override:
        other += ["--num-gpu-blocks-override", str(ns.num_gpu_blocks_override)]
    return ns.model, settings, other


def pod_api_key(cluster, namespace: str, pod: dict) -> str | None:
    """$VLLM_API_KEY as the kubelet would give the engine container: a plain `value`, or the
    Secret key a `valueFrom.secretKeyRef` names (base64-decoded `data`, Kubernetes API:
    "Using Secrets as environment variables")."""
    for var in pod["spec"]["containers"][0].get("env") or ():
        if var["name"] != "VLLM_API_KEY":
            continue
        if "value" in var:
            return var["value"]
        ref = var["valueFrom"]["secretKeyRef"]
        secrets = [o for o in cluster.objects("", "v1", "secrets", namespace) if o["metadata"]["name"] == ref["name"]]
        return base64.b64decode(secrets[0]["data"][ref["key"]]).decode() if secrets else None
    return None


class EngineBridge:
    def __init__(self, cluster, name: str, workdir: Path, namespace: str = "default"):
        self.cluster, self.name, self.namespace = cluster, name, namespace
        self.workdir = workdir
        self.port = free_port()
        self.engine: EngineProcess | None = None
        self.rollouts: list[tuple[str, str]] = []  # (config hash, how: start / live / restart)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-bridge", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.engine is not None:
            self.engine.stop()

    def _current_pod(self) -> dict | None:
        deployments = [d for d in self.cluster.objects("apps", "v1", "deployments", self.namespace)
                       if d["metadata"]["name"] == self.name]
        if not deployments:
            return None
        digest = deployments[0]["spec"]["template"]["metadata"]["annotations"].get(HASH_ANNOTATION)
        for pod in self.cluster.objects("", "v1", "pods", self.namespace, labels={ISVC_LABEL: self.name}):
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (pod.get("status") or {}).get("conditions") or ())
            if ready and pod["metadata"]["annotations"].get(HASH_ANNOTATION) == digest:
                return pod
        return None

    def _run(self) -> None:
        seen = None
        while not self._stop.is_set():
            pod = self._current_pod()
            digest = pod and pod["metadata"]["annotations"][HASH_ANNOTATION]
            if pod is not None and digest != seen:
                seen = digest
                model, settings, other = pod_engine(pod["spec"]["containers"][0]["args"])
                try:
                    self.rollouts.append((digest, self._apply(model, settings, other,
                                                              pod_api_key(self.cluster, self.namespace, pod))))
                except TrialFailed as e:
                    self.errors.append(str(e))
            time.sleep(0.2)

    def _apply(self, model: str, settings: EngineSettings, other: list[str], api_key: str | None) -> str:
        if self.engine is not None and self.engine.running and self.engine.extra_args == other \
                and self.engine.api_key == api_key:
            changes = self.engine.settings.live_changes(settings)
            if changes == {}:
                return "unchanged"
            if changes is not None and self.engine.apply_live(changes):
                return "live"
        if self.engine is not None:
            self.engine.stop()
        self.engine = EngineProcess(model, self.workdir / "engine.log", other, api_key=api_key, port=self.port)
        self.engine.start(settings)
        return "start"
