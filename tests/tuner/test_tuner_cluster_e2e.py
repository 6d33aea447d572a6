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

import json

import pytest
import yaml
from kube.pods import POD_START_TIMEOUT_S
from kube.rbac import access_of, missing
from kube.tools import ROOT, helm_template, wait_for
from kube.tuning_stack import ready, status_without_key, tuner_pod
from kube.tuning_stack import tuning_operator

from kvpilot.tuner.cluster.runner import flag_values

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


def test_applying_a_resource_with_tuning_on_tunes_it_and_leaves_the_best_in_the_spec(node, tmp_path):
    with tuning_operator(node, tmp_path, TUNER_ARGS, "tuner-e2e", NAME, API_KEY) as (cluster, kubectl, release, _):
        kubectl.apply(manifest())
        first = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the InferenceService Ready")
        service = f"http://{kubectl.json('get', 'service', NAME)['spec']['clusterIP']}:8000"
        anonymous = wait_for(lambda: status_without_key(service), 180, what="the engine answering")
        done = wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase")
                        == "Done", 900, what="status.tuning.phase Done")
        obj = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the final rollout")
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
    with tuning_operator(node, tmp_path, TUNER_ARGS, "tuner-e2e-groups", NAME, API_KEY, leaders_only=True) as (
            cluster, kubectl, release, _):
        kubectl.apply(manifest(max_trials=2, nnodes=2))
        first = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the group Ready")
        done = wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase")
                        == "Done", 900, what="status.tuning.phase Done")
        obj = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the final rollout")
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
