"""Fidelity of the emulated API server: each test states what a real kube-apiserver does."""
from __future__ import annotations

import base64
import collections
import json
import pathlib
import time

import httpx
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CM = "/api/v1/namespaces/default/configmaps"
DEP = "/apis/apps/v1/namespaces/default/deployments"
ISVC = "/apis/kvpilot.dev/v1alpha1/namespaces/default/inferenceservices"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def api(cluster):
    with httpx.Client(base_url=cluster.url, timeout=10) as client:
        yield client


@pytest.fixture
def crd(api):
    body = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
    assert api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=body).status_code == 201


def configmap(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}


def deployment(name: str, replicas: int = 1) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "img:1"}]}}}}


def isvc(name: str, **engine) -> dict:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"source": "builtin://smollm2-135m-instruct"}, "engine": engine}}


def poll(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_namespaces_are_listed_and_objects_need_an_existing_namespace(api):
    names = {n["metadata"]["name"] for n in api.get("/api/v1/namespaces").json()["items"]}
    assert {"default", "kube-system"} <= names
    assert api.get("/api/v1/namespaces/default").json()["status"]["phase"] == "Active"
    missing = api.post("/api/v1/namespaces/nowhere/configmaps", json=configmap("x"))
    assert missing.status_code == 404 and missing.json()["message"] == 'namespaces "nowhere" not found'


def test_create_answers_201_with_server_set_metadata_and_409_on_a_second_create(api):
    created = api.post(CM, json=configmap("a"))
    assert created.status_code == 201
    meta = created.json()["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"].endswith("Z")
    assert "generation" not in meta  # ConfigMaps have no generation; Deployments do
    assert api.post(DEP, json=deployment("d")).json()["metadata"]["generation"] == 1
    again = api.post(CM, json=configmap("a"))
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"


def test_kubectls_protobuf_creates_of_built_in_types_are_decoded(cluster, tmp_path):
    """API concepts, "Alternate representations of resources: Protobuf encoding": kubectl's
    typed commands POST built-in types as application/vnd.kubernetes.protobuf, which the API
    server decodes. Secret reference: stringData is merged into data on write and never read
    back; an empty type defaults to Opaque."""
    from cluster.tools import Kubectl

    kubectl = Kubectl(cluster.kubeconfig)
    (tmp_path / "key.txt").write_text("0f3a9c\n")
    kubectl("create", "namespace", "team-a")
    kubectl("create", "secret", "generic", "k", "-n", "team-a", "--from-file=api-key=key.txt",
            "--from-literal=user=admin", cwd=tmp_path)
    kubectl("create", "configmap", "c", "--from-literal=a=1", "--from-literal=b=two")
    secret = kubectl.json("get", "secret", "k", "-n", "team-a")
    assert secret["type"] == "Opaque" and secret["metadata"]["namespace"] == "team-a"
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {"api-key": "0f3a9c\n", "user": "admin"}
    assert kubectl.json("get", "configmap", "c")["data"] == {"a": "1", "b": "two"}
    assert kubectl("create", "configmap", "c", "--from-literal=a=1", check=False).returncode != 0  # 409 as JSON
    with httpx.Client(base_url=cluster.url, timeout=10) as api:
        merged = api.post("/api/v1/namespaces/default/secrets", json={
            "metadata": {"name": "s"}, "data": {"a": base64.b64encode(b"old").decode()}, "stringData": {"a": "new"}})
        assert merged.status_code == 201 and "stringData" not in merged.json()
        assert base64.b64decode(merged.json()["data"]["a"]) == b"new"


def test_a_body_the_server_cannot_decode_is_415(api):
    """A body in a media type or of a kind the server has no codec for is refused with 415
    Unsupported Media Type (a real server does so for protobuf bodies of custom resources);
    the emulator decodes protobuf only for Secret, ConfigMap and Namespace."""
    service_account = b"k8s\x00" + bytes([0x0a, 0x14, 0x0a, 0x02]) + b"v1" + bytes([0x12, 0x0e]) + b"ServiceAccount"
    for body, media in ((service_account, "application/vnd.kubernetes.protobuf"), (b"\xa1", "application/cbor")):
        refused = api.post(CM, content=body, headers={"Content-Type": media})
        assert refused.status_code == 415 and refused.json()["reason"] == "UnsupportedMediaType", refused.text
        assert "application/json" in refused.json()["message"]
    assert api.post(CM, json=configmap("after-415")).status_code == 201


def test_put_with_a_stale_resource_version_conflicts(api):
    obj = api.post(CM, json=configmap("a")).json()
    obj["data"]["k"] = "v2"
    updated = api.put(f"{CM}/a", json=obj)
    assert updated.status_code == 200
    assert int(updated.json()["metadata"]["resourceVersion"]) > int(obj["metadata"]["resourceVersion"])
    obj["data"]["k"] = "v3"  # still carries the old resourceVersion
    stale = api.put(f"{CM}/a", json=obj)
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"
    assert api.get(f"{CM}/a").json()["data"]["k"] == "v2"


def test_generation_moves_on_spec_changes_only_and_no_op_writes_keep_the_version(api):
    rv1 = api.post(DEP, json=deployment("d")).json()["metadata"]["resourceVersion"]
    labelled = api.patch(f"{DEP}/d", json={"metadata": {"labels": {"x": "y"}}}, headers=MERGE).json()
    assert labelled["metadata"]["generation"] == 1 and labelled["metadata"]["resourceVersion"] != rv1
    scaled = api.patch(f"{DEP}/d", json={"spec": {"replicas": 3}}, headers=MERGE).json()
    assert scaled["metadata"]["generation"] == 2
    rv = api.post(CM, json=configmap("c")).json()["metadata"]["resourceVersion"]
    same = api.patch(f"{CM}/c", json={"data": {"k": "v"}}, headers=MERGE).json()
    assert same["metadata"]["resourceVersion"] == rv


def test_patch_types_merge_strategic_and_json_patch(api):
    api.post(DEP, json=deployment("d"))
    strategic = {"spec": {"template": {"spec": {"containers": [{"name": "side", "image": "s:1"}]}}}}
    obj = api.patch(f"{DEP}/d", json=strategic, headers={"Content-Type": "application/strategic-merge-patch+json"}).json()
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["c", "side"]
    obj = api.patch(f"{DEP}/d", json=strategic, headers=MERGE).json()  # merge patch replaces lists
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["side"]
    ops = [{"op": "replace", "path": "/spec/replicas", "value": 4}]
    obj = api.patch(f"{DEP}/d", json=ops, headers={"Content-Type": "application/json-patch+json"}).json()
    assert obj["spec"]["replicas"] == 4


def test_label_and_field_selectors(api):
    for name, labels in (("a", {"tier": "web", "env": "prod"}), ("b", {"tier": "db"}), ("c", {})):
        api.post(CM, json=configmap(name, **labels))

    def names(**params) -> list[str]:
        return [i["metadata"]["name"] for i in api.get(CM, params=params).json()["items"]]
    assert names(labelSelector="tier=web") == ["a"]
    assert names(labelSelector="tier!=web") == ["b", "c"]
    assert names(labelSelector="tier in (web,db)") == ["a", "b"]
    assert names(labelSelector="tier notin (web)") == ["b", "c"]
    assert names(labelSelector="env") == ["a"] and names(labelSelector="!tier") == ["c"]
    assert names(labelSelector="tier,env=prod") == ["a"]
    assert names(fieldSelector="metadata.name=b") == ["b"]


def test_watch_resumes_after_a_resource_version_and_ends_at_its_timeout(api, cluster):
    rv = api.post(CM, json=configmap("a")).json()["metadata"]["resourceVersion"]
    api.patch(f"{CM}/a", json={"data": {"k": "2"}}, headers=MERGE)
    api.delete(f"{CM}/a")
    started = time.monotonic()
    with api.stream("GET", CM, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"}) as stream:
        events = [json.loads(line) for line in stream.iter_lines() if line]
    assert 0.9 < time.monotonic() - started < 5
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[0]["object"]["data"]["k"] == "2"
    cluster.call(lambda store: setattr(store, "log", collections.deque(list(store.log)[-1:], maxlen=1)))
    expired = api.get(CM, params={"watch": "true", "resourceVersion": "1"})
    assert expired.status_code == 410 and expired.json()["reason"] == "Expired"


def test_watch_with_a_selector_sees_objects_leave_it_as_deleted(api):
    api.post(CM, json=configmap("a", tier="web"))
    with api.stream("GET", CM, params={"watch": "true", "labelSelector": "tier=web", "timeoutSeconds": "1"}) as stream:
        api.patch(f"{CM}/a", json={"metadata": {"labels": {"tier": "db"}}}, headers=MERGE)
        events = [json.loads(line)["type"] for line in stream.iter_lines() if line]
    assert events == ["ADDED", "DELETED"]


def test_status_subresource_separates_spec_and_status_writes(api, crd):
    api.post(ISVC, json={**isvc("s"), "status": {"url": "ignored-on-create"}})
    obj = api.patch(f"{ISVC}/s", json={"spec": {"replicas": 2}, "status": {"url": "x"}}, headers=MERGE).json()
    assert obj["spec"]["replicas"] == 2 and "status" not in obj
    obj = api.patch(f"{ISVC}/s/status", json={"spec": {"replicas": 5}, "status": {"url": "u"}}, headers=MERGE).json()
    assert obj["status"]["url"] == "u" and obj["spec"]["replicas"] == 2
    assert obj["metadata"]["generation"] == 2  # spec change bumped it; the status write did not


def test_crd_schema_defaults_prunes_and_validates_with_cel(api, crd):
    obj = api.post(ISVC, json={**isvc("s"), "spec": {**isvc("s")["spec"], "bogus": 1}}).json()
    assert obj["spec"]["engine"]["maxNumBatchedTokens"] == 2048 and obj["spec"]["replicas"] == 1
    assert obj["spec"]["tuning"] == {"enabled": False, "maxTrials": 20, "trialSeconds": 120,
                                     "workload": "synthetic", "objective": "throughput"}
    assert "bogus" not in obj["spec"]
    bad = api.post(ISVC, json=isvc("b", maxNumSeqs=512, maxNumBatchedTokens=256))
    assert bad.status_code == 422 and bad.json()["reason"] == "Invalid"
    cause = bad.json()["details"]["causes"][0]
    assert cause["field"] == "spec.engine.maxNumBatchedTokens" and "must be >= maxNumSeqs" in cause["message"]
    enum = api.post(ISVC, json=isvc("b", dtype="int3")).json()
    assert enum["details"]["causes"][0]["field"] == "spec.engine.dtype" and "Unsupported value" in enum["message"]
    bound = api.post(ISVC, json=isvc("b", gpuMemoryUtilization=1.5)).json()
    assert bound["code"] == 422 and "spec.engine.gpuMemoryUtilization" in bound["message"]
    swap = api.post(ISVC, json=isvc("b", preemptionMode="swap", swapSpace=0)).json()
    assert "swapSpace > 0" in swap["message"]


def test_scale_subresource_reads_and_writes_spec_replicas(api, crd):
    api.post(ISVC, json=isvc("s"))
    api.patch(f"{ISVC}/s/status", json={"status": {"replicas": 1, "selector": "a=b"}}, headers=MERGE)
    scale = api.get(f"{ISVC}/s/scale").json()
    assert (scale["apiVersion"], scale["kind"]) == ("autoscaling/v1", "Scale")
    assert scale["spec"]["replicas"] == 1 and scale["status"] == {"replicas": 1, "selector": "a=b"}
    scale["spec"]["replicas"] = 3
    assert api.put(f"{ISVC}/s/scale", json=scale).json()["spec"]["replicas"] == 3
    assert api.get(f"{ISVC}/s").json()["spec"]["replicas"] == 3
    assert api.put(f"{ISVC}/s/scale", json=scale).status_code == 409  # stale resourceVersion
    discovery = api.get("/apis/kvpilot.dev/v1alpha1").json()["resources"]
    entry = next(r for r in discovery if r["name"] == "inferenceservices/scale")
    assert (entry["group"], entry["version"], entry["kind"]) == ("autoscaling", "v1", "Scale")


def test_garbage_collection_follows_owner_references(api):
    owner = api.post(CM, json=configmap("owner")).json()
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    for name in ("dep1", "dep2"):
        api.post(CM, json={**configmap(name), "metadata": {"name": name, "ownerReferences": [ref]}})
    api.delete(f"{CM}/owner")
    poll(lambda: api.get(f"{CM}/dep1").status_code == 404 and api.get(f"{CM}/dep2").status_code == 404)
    owner = api.post(CM, json=configmap("owner")).json()
    ref["uid"] = owner["metadata"]["uid"]
    api.post(CM, json={**configmap("kept"), "metadata": {"name": "kept", "ownerReferences": [ref]}})
    api.request("DELETE", f"{CM}/owner", json={"propagationPolicy": "Orphan"})
    time.sleep(0.2)
    kept = api.get(f"{CM}/kept").json()
    assert kept["metadata"]["ownerReferences"] == []
    dangling = {**ref, "uid": "no-such-uid"}
    api.post(CM, json={**configmap("dangling"), "metadata": {"name": "dangling", "ownerReferences": [dangling]}})
    poll(lambda: api.get(f"{CM}/dangling").status_code == 404)


def test_finalizers_hold_deletion_until_removed(api):
    api.post(CM, json={**configmap("f"), "metadata": {"name": "f", "finalizers": ["x/y"]}})
    held = api.delete(f"{CM}/f")
    assert held.status_code == 202 and held.json()["metadata"]["deletionTimestamp"]
    assert api.get(f"{CM}/f").status_code == 200
    api.patch(f"{CM}/f", json={"metadata": {"finalizers": None}}, headers=MERGE)
    assert api.get(f"{CM}/f").status_code == 404


def test_deployments_get_replicasets_and_pods_that_turn_ready(api, cluster):
    api.post(DEP, json=deployment("web", replicas=2))
    status = poll(lambda: (s := api.get(f"{DEP}/web").json().get("status", {})).get("readyReplicas") == 2 and s)
    assert status["observedGeneration"] == 1 and status["updatedReplicas"] == 2
    pods = api.get("/api/v1/namespaces/default/pods", params={"labelSelector": "app=web"}).json()["items"]
    assert len(pods) == 2 and all(p["status"]["phase"] == "Running" for p in pods)
    rs = api.get("/apis/apps/v1/namespaces/default/replicasets").json()["items"]
    assert [r["metadata"]["ownerReferences"][0]["name"] for r in rs] == ["web"]
    api.patch(f"{DEP}/web", json={"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "img:2"}]}}}},
              headers=MERGE)
    poll(lambda: {p["spec"]["containers"][0]["image"] for p in api.get(
        "/api/v1/namespaces/default/pods", params={"labelSelector": "app=web"}).json()["items"]} == {"img:2"})
    api.delete(f"{DEP}/web")
    poll(lambda: not api.get("/api/v1/namespaces/default/pods").json()["items"])
