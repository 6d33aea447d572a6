"""The in-cluster tuner end to end on a real node (tests/kube/node.py): `helm install` starts the
operator pod from the operator image with the tuner in it (`--tuner`, the chart's default) and
`tuner.prometheusUrl` set to a real Prometheus scraping each engine pod with a PodMonitor's
labels (the pods' addresses from the API server, see PodTargets). `kubectl
apply` of an InferenceService with tuning on starts the tuning daemon, which patches each trial
into spec.engine; the operator rolls it out as real Deployments whose pods run the engine image;
the tuner sends its ShareGPT load to the Service by its cluster DNS name (CoreDNS), measures each
window through PromQL, keeps the study in a ConfigMap, writes status.tuning and events, and
leaves the best settings in spec.engine. The engine has an API key (spec.engine.apiKeySecret):
the pods get it from the Secret, and so does the tuner, through the Kubernetes API with the
chart's RBAC (never a flag). The API server's audit log shows every request the operator's
ServiceAccount sent was allowed. A second resource spans two pods (spec.parallelism.nnodes 2,
one pipeline stage each): every trial rolls out as a group and is measured through node 0."""
from __future__ import annotations

import base64
import contextlib
import json
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from kube.cluster import Cluster
from kube.node import NODE_IP
from kube.pods import POD_START_TIMEOUT_S, wait_rolled_out
from kube.rbac import access_of, missing
from kube.release import Release
from kube.tools import ROOT, Kubectl, helm_template, wait_for

from kvpilot.bench.harness.prometheus import Prometheus
from kvpilot.tuner.cluster import flag_values

pytestmark = pytest.mark.slow
NAME = "tuned"
API_KEY = "tuner-e2e-key-0123456789"
REPORT_DIR = "/tmp/report"  # in the operator pod: its /tmp volume


TUNER_ARGS = ["--num-requests", "4", "--max-output-len", "16", "--max-prompt-len", "96", "--warmup-requests", "1",
              "--max-num-batched-tokens", "128:1024", "--max-num-seqs", "2:8", "--chunked-prefill", "on",
              "--remeasure-top", "0", "--rollout-timeout", "300", "--report-dir", REPORT_DIR]


def manifest(max_trials: int = 3, nnodes: int = 1) -> str:
    """The example resource, small, with an API key and tuning on; nnodes > 1: a pipeline
    stage per pod (pipelineParallelSize = nnodes; resources are per pod)."""
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["engine"].update(maxModelLen=512, maxNumSeqs=8, maxNumBatchedTokens=512,
                                 extraArgs=["--num-gpu-blocks-override", "48"],
                                 apiKeySecret={"name": f"{NAME}-api-key", "key": "api-key"})
    if nnodes > 1:
        doc["spec"]["engine"]["pipelineParallelSize"] = nnodes
        doc["spec"]["parallelism"] = {"nnodes": nnodes}
    doc["spec"]["slo"] = {"ttftP95Ms": 60000, "itlP95Ms": 5000, "maxPreemptionsPerMin": 1000}
    doc["spec"]["tuning"] = {"enabled": True, "maxTrials": max_trials, "trialSeconds": 10, "workload": "synthetic",
                             "objective": "goodput"}
    return yaml.safe_dump(doc)


class PodTargets:
    """Prometheus' targets file (file_sd) kept equal to the running pods of this resource, with
    the labels a PodMonitor gives them (namespace, pod, app_kubernetes_io_instance from
    podTargetLabels), polled from the API server every second: Debian's Prometheus 2.42 is built
    without kubernetes_sd_configs ("field kubernetes_sd_configs not found"), so this thread does
    the discovery the Prometheus Operator's config would, and Prometheus scrapes each pod."""

    def __init__(self, control_plane, namespace: str, path: Path, leaders_only: bool = False):
        self.control_plane, self.namespace, self.path = control_plane, namespace, path
        # groups (nnodes > 1): the PodMonitor selects node 0 of each group, the only pod serving HTTP
        self.selector = f"app.kubernetes.io%2Finstance%3D{NAME}" + (",kvpilot.dev%2Frole%3Dleader" if leaders_only
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
                                   "app_kubernetes_io_instance": NAME}}
                       for p in pods if p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP")]
            text = json.dumps(targets)
            if text != self.path.read_text():
                self.path.with_suffix(".tmp").write_text(text)
                self.path.with_suffix(".tmp").replace(self.path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def status_without_key(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/v1/models", timeout=10).status_code
    except httpx.TransportError:
        return None


def ready(kubectl) -> dict | None:
    obj = kubectl.json("get", "isvc", NAME)
    conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
    fresh = obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
    return obj if fresh and conds.get("Ready") == "True" else None


@contextlib.contextmanager
def tuning_operator(node, tmp_path: Path, tuner_args: list[str], namespace: str = "tuner-e2e",
                    leaders_only: bool = False) -> Iterator[tuple[Cluster, Kubectl, Release]]:
    """The chart installed in `namespace` (each test its own: a deleted namespace takes a while
    to go), its operator pod running the tuner with `tuner_args` and a real Prometheus (scraping
    the resource's serving pods), and the engine's API key in a Secret; uninstalled at the end."""
    with Cluster(node, namespace, tmp_path) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        targets = PodTargets(node, cluster.namespace, tmp_path / "targets.json", leaders_only)
        prometheus = Prometheus(tmp_path, [targets.scrape_config()], address=NODE_IP)
        release = Release(cluster, "kv", f"--set-string=tuner.extraArgs={shlex.join(tuner_args)}",
                          f"--set-string=tuner.prometheusUrl={prometheus.url}")
        try:
            release.install()
            wait_rolled_out(kubectl, release.service_account, POD_START_TIMEOUT_S)  # the chart's full name
            kubectl.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{NAME}-api-key"},
                                          "data": {"api-key": base64.b64encode(API_KEY.encode()).decode()}}))
            yield cluster, kubectl, release
        finally:
            prometheus.stop()
            targets.stop()
            release.uninstall()


def tuner_pod(kubectl, release: Release) -> str:
    """The chart runs two replicas: the tuner runs in the one holding the Lease (named after the release)."""
    return f"pod/{kubectl.json('get', 'lease', release.service_account)['spec']['holderIdentity']}"


def test_applying_a_resource_with_tuning_on_tunes_it_and_leaves_the_best_in_the_spec(node, tmp_path):
    with tuning_operator(node, tmp_path, TUNER_ARGS) as (cluster, kubectl, release):
        kubectl.apply(manifest())
        first = wait_for(lambda: ready(kubectl), POD_START_TIMEOUT_S, what="the InferenceService Ready")
        service = f"http://{kubectl.json('get', 'service', NAME)['spec']['clusterIP']}:8000"
        anonymous = wait_for(lambda: status_without_key(service), 180, what="the engine answering")
        done = wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase")
                        == "Done", 900, what="status.tuning.phase Done")
        obj = wait_for(lambda: ready(kubectl), POD_START_TIMEOUT_S, what="the final rollout")
        journal = kubectl.json("get", "configmap", f"{NAME}-tuning")  # the study, kept in the cluster
        row = kubectl("get", "isvc", NAME).stdout.splitlines()[1].split()
        events = kubectl.json("get", "events", "--field-selector", f"involvedObject.name={NAME}")["items"]
        replicasets = kubectl.json("get", "replicasets", "-l", f"app.kubernetes.io/instance={NAME}")["items"]
        template = kubectl.json("get", "deployment", NAME)["spec"]["template"]["spec"]["containers"][0]
        in_pod = tuner_pod(kubectl, release)
        report = json.loads(kubectl("exec", in_pod, "--", "cat", f"{REPORT_DIR}/report.json").stdout)
        manifest_written = kubectl("exec", in_pod, "--", "test", "-f", f"{REPORT_DIR}/inferenceservice.yaml",
                                   check=False).returncode == 0
        operator_log = kubectl("logs", in_pod).stdout
        requests = cluster.requests(release.username)
        sent = {a for e in requests if (a := access_of(e))}

    assert done, operator_log[-3000:]
    # the engine refused requests without the key; the tuner, which was given none, read it
    # from the Secret and measured every trial through the authenticated API
    assert anonymous == 401
    assert [v["valueFrom"]["secretKeyRef"] for v in template["env"] if v["name"] == "VLLM_API_KEY"] == [
        {"name": f"{NAME}-api-key", "key": "api-key"}]
    assert API_KEY not in operator_log  # never logged
    # the API server granted every request the operator and the tuner sent as the chart's ServiceAccount
    assert [(e["verb"], e["requestURI"]) for e in requests if e.get("responseStatus", {}).get("code") == 403] == []
    assert {"configmaps", "inferenceservices/status", "secrets"} <= {a.resource for a in sent}
    assert [str(a) for a in missing(sent, helm_template(f"--set=watch.namespaces={{{cluster.namespace}}}",
                                                            f"--namespace={cluster.namespace}"))] == []
    assert journal["metadata"]["ownerReferences"][0]["name"] == NAME
    assert "Done" in row  # the TUNING printer column
    tuning = obj["status"]["tuning"]
    assert tuning["phase"] == "Done"
    assert [h["trial"] for h in tuning["history"]] == [0, 1, 2]
    # every trial measured through Prometheus (on a busy 2-core node a trial may miss the SLO)
    assert {h["verdict"] for h in tuning["history"]} <= {"measured", "violates_slo"}, (
        tuning["history"], operator_log[-4000:])
    # the best settings are in the spec, and the pods' flags (appliedEngineArgs) carry them
    engine = obj["spec"]["engine"]
    assert {k: engine[k] for k in tuning["bestEngine"]} == tuning["bestEngine"]
    flags = flag_values(obj["status"]["appliedEngineArgs"])
    assert flags["max_num_seqs"] == str(engine["maxNumSeqs"])
    assert flags["max_num_batched_tokens"] == str(engine["maxNumBatchedTokens"])
    # trials 1 and 2 and the final apply each rolled out a new generation (trial 0 = the spec as it
    # was), each a ReplicaSet of real pods
    assert obj["metadata"]["generation"] > first["metadata"]["generation"]
    assert len(replicasets) >= 2
    reasons = [e["reason"] for e in events]
    assert "TuningStarted" in reasons and reasons.count("TuningTrial") == 3 and "TuningDone" in reasons
    assert manifest_written
    assert report["defaults"]["settings"]["max_num_seqs"] == 8  # trial 0: what ran before tuning
    assert {t["measurement"]["source"] for t in report["trials"]} == {"prometheus"}
    assert report["best"]["number"] == tuning["bestTrial"]
    assert report["applied"] == tuning["bestEngine"]


def test_the_in_cluster_tuner_runs_its_trials_on_two_pod_groups(node, tmp_path):
    with tuning_operator(node, tmp_path, TUNER_ARGS, "tuner-e2e-groups", leaders_only=True) as (
            cluster, kubectl, release):
        kubectl.apply(manifest(max_trials=2, nnodes=2))
        first = wait_for(lambda: ready(kubectl), POD_START_TIMEOUT_S, what="the group Ready")
        done = wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase")
                        == "Done", 900, what="status.tuning.phase Done")
        obj = wait_for(lambda: ready(kubectl), POD_START_TIMEOUT_S, what="the final rollout")
        pods = kubectl.json("get", "pods", "-l", f"app.kubernetes.io/instance={NAME}")["items"]
        deployments = kubectl.json("get", "deployments", "-l", f"app.kubernetes.io/instance={NAME}")["items"]
        events = kubectl.json("get", "events", "--field-selector", f"involvedObject.name={NAME}")["items"]
        in_pod = tuner_pod(kubectl, release)
        report = json.loads(kubectl("exec", in_pod, "--", "cat", f"{REPORT_DIR}/report.json").stdout)
        operator_log = kubectl("logs", in_pod).stdout

    assert done, operator_log[-3000:]
    tuning = obj["status"]["tuning"]
    # both trials ran on the two-pod layout and were measured through node 0 (Prometheus scrapes it)
    assert [(h["trial"], h["nnodes"]) for h in tuning["history"]] == [(0, 2), (1, 2)], operator_log[-4000:]
    assert {h["verdict"] for h in tuning["history"]} <= {"measured", "violates_slo"}, (
        tuning["history"], operator_log[-4000:])
    assert {t["settings"]["nnodes"] for t in report["trials"]} == {2}
    assert {t["measurement"]["source"] for t in report["trials"]} == {"prometheus"}
    # trial 1 (and the final apply) rolled out a new generation as a group: the operator replaced
    # the group's pods for the new configuration, and no Deployment ran the engine
    assert obj["metadata"]["generation"] > first["metadata"]["generation"]
    assert obj["spec"]["parallelism"]["nnodes"] == 2 and obj["status"]["groupSize"] == 2
    assert any(e["reason"] == "RecreatingGroup" and "old configuration" in e["message"] for e in events), [
        (e["reason"], e["message"]) for e in events]
    assert deployments == []
    assert sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")) == [
        f"{NAME}-0", f"{NAME}-0-1"]
