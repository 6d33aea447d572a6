"""The tuner on a real API server (tests/kube) with the real operator, run as the chart's
ServiceAccount after `helm install`, so the API server enforces the chart's RBAC: `kubectl apply` of an
InferenceService with tuning on starts the tuning daemon (kvpilot.tuner.daemon, loaded into
the operator's Kopf process), which patches each trial into spec.engine; the operator rolls
it out; the engine that the pods stand for (a real `kvpilot serve`, see engine_bridge.py)
serves the tuner's ShareGPT load; a real Prometheus scrapes it with the labels a PodMonitor
adds; the tuner measures through PromQL, keeps the study in a ConfigMap, writes
status.tuning and events, and leaves the best settings in spec.engine. The engine has an
API key (spec.engine.apiKeySecret): the pods get it from the Secret, and so does the tuner,
through the Kubernetes API with the chart's RBAC (it is never a flag)."""
from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys

import httpx
import pytest
import yaml
from kube.rbac import access_of, missing
from kube.release import Release
from kube.tools import ROOT, Kubectl, chart_operator_command, free_port, helm_template, wait_for
from engine_bridge import EngineBridge
from prometheus_harness import Prometheus

from kvpilot.tuner.cluster import flag_values

pytestmark = pytest.mark.slow
NAME = "tuned"
API_KEY = "tuner-e2e-key-0123456789"


def manifest() -> str:
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["engine"].update(maxModelLen=512, maxNumSeqs=8, maxNumBatchedTokens=512,
                                 extraArgs=["--num-gpu-blocks-override", "48"],
                                 apiKeySecret={"name": f"{NAME}-api-key", "key": "api-key"})
    doc["spec"]["slo"] = {"ttftP95Ms": 60000, "itlP95Ms": 5000, "maxPreemptionsPerMin": 1000}
    doc["spec"]["tuning"] = {"enabled": True, "maxTrials": 3, "trialSeconds": 10, "workload": "synthetic",
                             "objective": "goodput"}
    return yaml.safe_dump(doc)


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


def operator_with_tuner(kubeconfig, log, tuner_args: list[str], prometheus_url: str,
                        namespace: str) -> subprocess.Popen:
    """The operator's handlers and the tuning daemon in one Kopf process."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPILOT_RESYNC_SECONDS": "1",
           "KVPILOT_WATCH_TIMEOUT_SECONDS": "30", "KVPILOT_TUNER_ARGS": shlex.join(tuner_args),
           "KVPILOT_PROMETHEUS_URL": prometheus_url}
    command = chart_operator_command(namespace)  # the chart's `kvpilot operator ... --tuner`
    args = [a.replace("0.0.0.0:8080", f"127.0.0.1:{free_port()}").replace("--metrics-port=9090", f"--metrics-port={free_port()}")
            for a in command[2:]]
    return subprocess.Popen([sys.executable, "-m", "kvpilot.cli.operator", *args],
                            env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)


def test_applying_a_resource_with_tuning_on_tunes_it_and_leaves_the_best_in_the_spec(cluster, tmp_path):
    kubectl = Kubectl(cluster.kubeconfig)
    release = Release(cluster, f"kv-{cluster.namespace}").install()
    bridge = EngineBridge(cluster, NAME, tmp_path, cluster.namespace)
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{bridge.port}",
                            {"namespace": cluster.namespace, "app_kubernetes_io_instance": NAME})
    log = tmp_path / "operator.log"
    operator = operator_with_tuner(release.operator_kubeconfig(tmp_path / "kubeconfig"), log, [
        "--target-url", bridge.url, "--num-requests", "4", "--max-output-len", "16", "--max-prompt-len", "96",
        "--warmup-requests", "1", "--max-num-batched-tokens", "128:1024", "--max-num-seqs", "2:8",
        "--chunked-prefill", "on", "--remeasure-top", "0", "--rollout-timeout", "120",
        "--report-dir", str(tmp_path / "report")], prometheus.url, cluster.namespace)
    try:
        bridge.start()
        kubectl.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{NAME}-api-key"},
                                      "data": {"api-key": base64.b64encode(API_KEY.encode()).decode()}}))
        kubectl.apply(manifest())
        first = wait_for(lambda: ready(kubectl), 60, what="the InferenceService Ready")
        anonymous = wait_for(lambda: status_without_key(bridge.url), 180, what="the engine answering")
        done = wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase")
                        == "Done", 300, what="status.tuning.phase Done")
        assert done, log.read_text()[-3000:]
        obj = wait_for(lambda: ready(kubectl), 60, what="the final rollout")
        journal = kubectl.json("get", "configmap", f"{NAME}-tuning")  # the study, kept in the cluster
        row = kubectl("get", "isvc", NAME).stdout.splitlines()[1].split()
        events = kubectl.json("get", "events", "--field-selector", f"involvedObject.name={NAME}")["items"]
        requests = cluster.requests(release.username)
        sent = {a for e in requests if (a := access_of(e))}
    finally:
        operator.terminate()
        operator.wait(30)
        prometheus.stop()
        bridge.stop()
        release.uninstall()

    assert bridge.errors == []
    # the engine refused requests without the key; the tuner, which was given none, read it
    # from the Secret and measured every trial through the authenticated API
    assert anonymous == 401 and bridge.engine.api_key == API_KEY
    assert API_KEY not in log.read_text()  # never logged
    # the API server granted every request the operator and the tuner sent as the chart's ServiceAccount
    assert [(e["verb"], e["requestURI"]) for e in requests if e.get("responseStatus", {}).get("code") == 403] == []
    assert {"configmaps", "inferenceservices/status", "secrets"} <= {a.resource for a in sent}
    assert [str(a) for a in missing(sent, helm_template(f"--set=watch.namespaces={{{cluster.namespace}}}"))] == []
    assert journal["metadata"]["ownerReferences"][0]["name"] == NAME
    assert "Done" in row  # the TUNING printer column
    tuning = obj["status"]["tuning"]
    assert tuning["phase"] == "Done"
    assert [h["trial"] for h in tuning["history"]] == [0, 1, 2]
    assert all(h["verdict"] == "measured" for h in tuning["history"])
    # the best settings are in the spec, and the pods' flags (appliedEngineArgs) carry them
    engine = obj["spec"]["engine"]
    assert {k: engine[k] for k in tuning["bestEngine"]} == tuning["bestEngine"]
    flags = flag_values(obj["status"]["appliedEngineArgs"])
    assert flags["max_num_seqs"] == str(engine["maxNumSeqs"])
    assert flags["max_num_batched_tokens"] == str(engine["maxNumBatchedTokens"])
    # trials 1 and 2 and the final apply each rolled out a new generation (trial 0 = the spec as it was)
    assert obj["metadata"]["generation"] > first["metadata"]["generation"]
    reasons = [e["reason"] for e in events]
    assert "TuningStarted" in reasons and reasons.count("TuningTrial") == 3 and "TuningDone" in reasons
    assert len(bridge.rollouts) >= 2 and bridge.rollouts[0][1] == "start"
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (tmp_path / "report" / "inferenceservice.yaml").is_file()
    assert report["defaults"]["settings"]["max_num_seqs"] == 8  # trial 0: what ran before tuning
    assert {t["measurement"]["source"] for t in report["trials"]} == {"prometheus"}
    assert report["best"]["number"] == tuning["bestTrial"]
    assert report["applied"] == tuning["bestEngine"]
