"""Multi-pod InferenceServices (spec.parallelism.nnodes > 1) through the real operator and a
real API server with its controllers (the StatefulSet controller creates the pods and their
pod-index labels; a kwok node makes them Running and Ready without containers), authenticated
as the chart's ServiceAccount, so the chart's RBAC for StatefulSets and pods is exercised. The
engines themselves run on the real node in tests/images/test_multinode.py."""
from __future__ import annotations

import json

import yaml
from kube.tools import ROOT, wait_for

EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"
STATEFULSETS = ("apps", "v1", "statefulsets")
PODS = ("", "v1", "pods")


def manifest(name: str, nnodes: int, replicas: int = 1, **engine) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["replicas"] = replicas
    doc["spec"]["engine"].update({"pipelineParallelSize": 2, **engine})
    doc["spec"]["parallelism"] = {"nnodes": nnodes}
    return yaml.safe_dump(doc)


def ready_groups(kubectl, name: str, groups: int) -> dict | None:
    obj = kubectl.json("get", "isvc", name)
    status = obj.get("status", {})
    ok = (status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("readyReplicas") == groups
          and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])))
    return obj if ok else None


def pods(cluster, name: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in cluster.objects(*PODS, labels={"kvpilot.dev/inferenceservice": name})
            if not p["metadata"].get("deletionTimestamp")}


def uids(cluster, name: str) -> dict[str, str]:
    return {n: p["metadata"]["uid"] for n, p in pods(cluster, name).items()}


def test_two_groups_of_two_pods_become_ready_with_the_leaders_behind_the_service(cluster, kubectl, operator):
    kubectl.apply(manifest("grp", nnodes=2, replicas=2))
    obj = wait_for(lambda: ready_groups(kubectl, "grp", 2), what="2 groups ready", timeout=120)
    status = obj["status"]
    assert status["groupSize"] == 2 and status["replicaSummary"] == "2/2"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "AllGroupsReady" and "2/2 groups of 2 pods ready" in ready["message"]
    assert set(pods(cluster, "grp")) == {"grp-0", "grp-1", "grp-0-1", "grp-1-1"}
    assert pods(cluster, "grp")["grp-1-1"]["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "1"
    names = {s["metadata"]["name"] for s in cluster.objects(*STATEFULSETS, labels={"kvpilot.dev/inferenceservice": "grp"})}
    assert names == {"grp", "grp-0", "grp-1"}
    assert not cluster.objects("apps", "v1", "deployments", labels={"kvpilot.dev/inferenceservice": "grp"})
    endpoints = kubectl.json("get", "endpoints", "grp")
    addresses = [a["targetRef"]["name"] for s in endpoints.get("subsets", []) for a in s.get("addresses", [])]
    assert sorted(addresses) == ["grp-0", "grp-1"]  # node 0 of each group only
    headless = kubectl.json("get", "service", "grp-group")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True


def test_a_restarted_worker_recreates_its_group_only(cluster, kubectl, operator):
    wait_for(lambda: ready_groups(kubectl, "grp", 2), what="2 groups ready", timeout=120)
    before = uids(cluster, "grp")
    # what the kubelet reports after the worker's engine exited and its container restarted
    kubectl("patch", "pod", "grp-1-1", "--subresource=status", "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/status/containerStatuses/0/restartCount", "value": 1}]))

    def recreated() -> dict | None:
        now = uids(cluster, "grp")
        fresh = set(now) == set(before) and now["grp-1"] != before["grp-1"] and now["grp-1-1"] != before["grp-1-1"]
        return now if fresh and ready_groups(kubectl, "grp", 2) else None
    now = wait_for(recreated, what="group 1 recreated and ready", timeout=120)
    assert now["grp-0"] == before["grp-0"] and now["grp-0-1"] == before["grp-0-1"]  # group 0 untouched
    events = kubectl.json("get", "events", "--field-selector", "involvedObject.name=grp")["items"]
    assert any(e["reason"] == "RecreatingGroup" and "group 1: pod grp-1-1 restarted" in e["message"] for e in events)


def test_a_new_configuration_replaces_every_group(cluster, kubectl, operator):
    obj = wait_for(lambda: ready_groups(kubectl, "grp", 2), what="2 groups ready", timeout=120)
    before, old_hash = uids(cluster, "grp"), obj["status"]["configHash"]
    kubectl("patch", "isvc", "grp", "--type", "merge", "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 32}}}))

    def rolled() -> dict | None:
        obj = ready_groups(kubectl, "grp", 2)
        now = uids(cluster, "grp")
        return obj if obj and obj["status"]["configHash"] != old_hash and len(now) == 4 and \
            not set(now.values()) & set(before.values()) else None
    obj = wait_for(rolled, what="both groups replaced", timeout=180)
    for pod in pods(cluster, "grp").values():
        assert pod["metadata"]["annotations"]["kvpilot.dev/config-hash"] == obj["status"]["configHash"]
        assert "32" == pod["spec"]["containers"][0]["args"][pod["spec"]["containers"][0]["args"].index("--max-num-seqs") + 1]


def test_scaling_in_removes_a_group_and_one_pod_goes_back_to_a_deployment(cluster, kubectl, operator):
    wait_for(lambda: ready_groups(kubectl, "grp", 2), what="2 groups ready", timeout=180)
    kubectl("scale", "isvc/grp", "--replicas=1")
    wait_for(lambda: {s["metadata"]["name"] for s in cluster.objects(*STATEFULSETS, labels={
        "kvpilot.dev/inferenceservice": "grp"})} == {"grp", "grp-0"}, what="group 1's StatefulSet gone")
    wait_for(lambda: ready_groups(kubectl, "grp", 1), what="1 group ready")
    kubectl("patch", "isvc", "grp", "--type", "merge", "-p", json.dumps({"spec": {"parallelism": {"nnodes": 1}}}))

    def single() -> dict | None:
        obj = ready_groups(kubectl, "grp", 1)
        left = cluster.objects(*STATEFULSETS, labels={"kvpilot.dev/inferenceservice": "grp"})
        gone = kubectl("get", "service", "grp-group", check=False).returncode != 0
        return obj if obj and not left and gone and "groupSize" not in obj["status"] else None
    wait_for(single, what="a Deployment again, the group objects gone", timeout=120)
    assert cluster.objects("apps", "v1", "deployments", labels={"kvpilot.dev/inferenceservice": "grp"})
    assert kubectl.json("get", "service", "grp")["spec"]["selector"] == {
        "app.kubernetes.io/name": "kvpilot-engine", "app.kubernetes.io/instance": "grp"}
    kubectl("delete", "isvc", "grp")


def test_a_name_too_long_for_a_groups_statefulsets_is_refused(kubectl, operator):
    result = kubectl.apply(manifest("g" * 50, nnodes=2), check=False)
    assert result.returncode != 0 and "at most 49 characters" in result.stderr
    assert kubectl.apply(manifest("g" * 49, nnodes=2, replicas=0)).returncode == 0
    kubectl("delete", "isvc", "g" * 49)
