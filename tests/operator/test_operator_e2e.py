"""The real operator process against a real API server (tests/kube: kube-apiserver,
controller manager, scheduler and a kwok node whose pods turn Ready), driven with kubectl,
authenticated as the ServiceAccount that `helm install` of the chart created, so the API
server enforces the chart's RBAC on every request."""
from __future__ import annotations

import json
import time

import pytest
import yaml
from kube.takeover import lease_name
from kube.tools import ROOT, helm_template, wait_for
from kube.rbac import Access, access_of, missing

EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"
ISVC = ("kvpilot.dev", "v1alpha1", "inferenceservices")
DEPLOYMENTS = ("apps", "v1", "deployments")


def manifest(name: str, **engine) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["engine"].update(engine)
    return yaml.safe_dump(doc)


def condition(obj: dict, type_: str) -> dict:
    return next(c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_)


def ready(kubectl, name: str) -> dict | None:
    obj = kubectl.json("get", "isvc", name)
    meta, status = obj["metadata"], obj.get("status", {})
    fresh = status.get("observedGeneration") == meta["generation"]
    return obj if fresh and condition(obj, "Ready")["status"] == "True" else None


def children(cluster, name: str) -> dict[str, dict]:
    found = {}
    for key, (group, version, plural, child) in {
        "deployment": ("apps", "v1", "deployments", name), "service": ("", "v1", "services", name),
        "configmap": ("", "v1", "configmaps", f"{name}-engine")}.items():
        found[key] = next((o for o in cluster.objects(group, version, plural) if o["metadata"]["name"] == child), None)
    return found


def test_apply_example_creates_owned_children_and_reaches_ready(cluster, kubectl, operator):
    assert "created" in kubectl.apply(EXAMPLE).stdout
    obj = wait_for(lambda: ready(kubectl, "smollm2"), what="smollm2 Ready")
    uid = obj["metadata"]["uid"]
    for kind, child in children(cluster, "smollm2").items():
        assert child is not None, kind
        refs = child["metadata"]["ownerReferences"]
        assert [(r["kind"], r["name"], r["uid"], r["controller"]) for r in refs] == \
            [("InferenceService", "smollm2", uid, True)], kind
    status = obj["status"]
    assert status["readyReplicas"] == 1 and status["replicas"] == 1
    assert status["url"] == f"http://smollm2.{cluster.namespace}.svc:8000/v1"
    assert status["appliedEngineArgs"][:3] == ["kvpilot", "serve", "builtin://smollm2-135m-instruct"]
    assert status["selector"] == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/name=kvpilot-engine"
    assert {c["type"]: c["status"] for c in status["conditions"]} == \
        {"Ready": "True", "Progressing": "False", "Degraded": "False", "Failed": "False"}
    # printer columns through server-side printing
    row = kubectl("get", "isvc", "smollm2").stdout.splitlines()
    assert row[0].split() == ["NAME", "READY", "REPLICAS", "URL", "TUNING", "AGE"]
    assert row[1].split()[:4] == ["smollm2", "True", "1/1", f"http://smollm2.{cluster.namespace}.svc:8000/v1"]
    # what the operator did is in the events
    events = wait_for(lambda: kubectl.json("get", "events", "--field-selector", "involvedObject.name=smollm2")["items"],
                      what="events")
    assert {"Created"} <= {e["reason"] for e in events}
    assert any("Deployment smollm2" in e["message"] for e in events)


def test_engine_change_rolls_out_a_new_configuration(cluster, kubectl, operator):
    before = wait_for(lambda: ready(kubectl, "smollm2"))
    old_hash = before["status"]["configHash"]
    kubectl("patch", "isvc", "smollm2", "--type", "merge", "-p",
            json.dumps({"spec": {"engine": {"maxNumBatchedTokens": 4096}}}))

    def rolled() -> dict | None:
        obj = ready(kubectl, "smollm2")
        return obj if obj and obj["metadata"]["generation"] == 2 and obj["status"]["configHash"] != old_hash else None
    after = wait_for(rolled, what="the new configuration Ready")
    args = after["status"]["appliedEngineArgs"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    deployment = children(cluster, "smollm2")["deployment"]
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["kvpilot.dev/config-hash"] == after["status"]["configHash"]
    container_args = template["spec"]["containers"][0]["args"]
    assert container_args[container_args.index("--max-num-batched-tokens") + 1] == "4096"
    configmap = children(cluster, "smollm2")["configmap"]
    assert "4096" in json.loads(configmap["data"]["engine-args.json"])
    # the pods were replaced: every running pod carries the new hash
    pods = cluster.objects("", "v1", "pods", labels={"app.kubernetes.io/instance": "smollm2"})
    assert pods and {p["metadata"]["annotations"]["kvpilot.dev/config-hash"] for p in pods} == \
        {after["status"]["configHash"]}


def test_schema_and_cel_refuse_invalid_resources_with_their_message(kubectl, operator):
    result = kubectl.apply(manifest("bad-budget", maxNumSeqs=128, maxNumBatchedTokens=64), check=False)
    assert result.returncode != 0
    assert "maxNumBatchedTokens must be >= maxNumSeqs" in result.stderr
    result = kubectl.apply(manifest("bad-chunking", enableChunkedPrefill=False, maxNumBatchedTokens=512), check=False)
    assert result.returncode != 0 and "enableChunkedPrefill false" in result.stderr
    result = kubectl.apply(manifest("bad-runtime", runtime="tgi"), check=False)
    assert result.returncode != 0 and 'supported values: "kvpilot", "vllm"' in result.stderr
    assert kubectl("get", "isvc", "bad-budget", check=False).returncode != 0


def test_a_spec_that_cannot_run_gets_failed_and_no_children(cluster, kubectl, operator):
    kubectl.apply(manifest("bad-tp", tensorParallelSize=2))

    def failed() -> dict | None:
        obj = kubectl.json("get", "isvc", "bad-tp")
        return obj if obj.get("status") and condition(obj, "Failed")["status"] == "True" else None
    obj = wait_for(failed, what="Failed condition")
    cond = condition(obj, "Failed")
    assert cond["reason"] == "InvalidParallelism" and "does not divide" in cond["message"]
    assert condition(obj, "Ready")["status"] == "False"
    assert all(child is None for child in children(cluster, "bad-tp").values())
    # fixing the spec brings the children up
    kubectl("patch", "isvc", "bad-tp", "--type", "merge", "-p", '{"spec": {"engine": {"tensorParallelSize": 3}}}')
    fixed = wait_for(lambda: ready(kubectl, "bad-tp"), what="fixed resource Ready")
    assert condition(fixed, "Failed")["status"] == "False"
    kubectl("delete", "isvc", "bad-tp")


def test_kubectl_scale_goes_through_the_scale_subresource(cluster, kubectl, operator):
    wait_for(lambda: ready(kubectl, "smollm2"))
    assert "scaled" in kubectl("scale", "isvc/smollm2", "--replicas=2").stdout
    obj = wait_for(lambda: (o := ready(kubectl, "smollm2")) and o["status"]["readyReplicas"] == 2 and o,
                   what="two ready replicas")
    assert obj["spec"]["replicas"] == 2 and obj["status"]["replicaSummary"] == "2/2"
    assert children(cluster, "smollm2")["deployment"]["spec"]["replicas"] == 2
    scale = json.loads(kubectl("get", "--raw", f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}"
                                               "/inferenceservices/smollm2/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2


@pytest.fixture
def long_resync(operator):
    """The operator restarted with a resync interval no wait here outlasts (600 s, the first
    pass's first visit 200 s or more away): what is repaired meanwhile, the children's own
    watches repaired (operator/child_watch.py). Restored to the tests' 1 s after."""
    operator.stop()
    operator.env["KVPILOT_RESYNC_SECONDS"] = "600"
    operator.start()
    yield operator
    operator.stop()
    operator.env["KVPILOT_RESYNC_SECONDS"] = "1"
    operator.start()


def test_a_deleted_child_comes_back_and_a_hand_edit_is_undone(cluster, kubectl, long_resync):
    wait_for(lambda: ready(kubectl, "smollm2"))
    old_uid = children(cluster, "smollm2")["service"]["metadata"]["uid"]
    kubectl("delete", "service", "smollm2")
    wait_for(lambda: (s := children(cluster, "smollm2")["service"]) and s["metadata"]["uid"] != old_uid,
             what="the Service recreated")
    kubectl("patch", "deployment", "smollm2", "--type", "merge", "-p",
            json.dumps({"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "evil:latest"}]}}}}))
    wait_for(lambda: children(cluster, "smollm2")["deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
             == "kvpilot/engine-cpu:0.1.0", what="the Deployment restored")
    # the Deployment's watch handler says what it repaired in an Event
    wait_for(lambda: [e for e in kubectl.json("get", "events", "--field-selector", "involvedObject.name=smollm2")["items"]
                      if e["reason"] == "DriftRepaired" and e["message"].startswith("updated Deployment smollm2")],
             what="a DriftRepaired event")
    kubectl("delete", "configmap", "smollm2-engine")
    wait_for(lambda: children(cluster, "smollm2")["configmap"], what="the ConfigMap recreated")


def test_an_operator_restart_creates_no_duplicates(cluster, kubectl, operator):
    wait_for(lambda: ready(kubectl, "smollm2"))
    uids = {k: v["metadata"]["uid"] for k, v in children(cluster, "smollm2").items()}
    operator.stop()
    kubectl.apply(manifest("while-down"))
    operator.start()
    wait_for(lambda: ready(kubectl, "while-down"), what="resource created while the operator was down")
    wait_for(lambda: ready(kubectl, "smollm2"))
    assert {k: v["metadata"]["uid"] for k, v in children(cluster, "smollm2").items()} == uids
    for name in ("smollm2", "while-down"):
        deployments = cluster.objects(*DEPLOYMENTS, labels={"kvpilot.dev/inferenceservice": name})
        assert len(deployments) == 1
    owned = [o for kind in (DEPLOYMENTS, ("", "v1", "services")) for o in cluster.objects(*kind)
             if "kvpilot.dev/inferenceservice" in o["metadata"].get("labels", {})]  # not the chart's own
    assert len(owned) == 4


def test_deleting_the_resource_removes_its_children(cluster, kubectl, operator):
    wait_for(lambda: ready(kubectl, "while-down"))
    kubectl("delete", "isvc", "while-down")
    wait_for(lambda: all(c is None for c in children(cluster, "while-down").values()), what="children gone")
    wait_for(lambda: not cluster.objects("", "v1", "pods", labels={"app.kubernetes.io/instance": "while-down"}),
             what="pods gone")
    assert children(cluster, "smollm2")["deployment"] is not None


def test_pods_that_never_become_ready_show_degraded(cluster, kubectl, operator):
    kubectl.apply(manifest("broken", image="kvpilot/kvpilot:broken"))

    def degraded() -> dict | None:
        obj = kubectl.json("get", "isvc", "broken")
        return obj if obj.get("status") and condition(obj, "Degraded")["status"] == "True" else None
    obj = wait_for(degraded, what="Degraded condition")
    assert condition(obj, "Degraded")["reason"] == "ReplicasUnavailable"
    assert condition(obj, "Ready")["status"] == "False" and condition(obj, "Failed")["status"] == "False"
    kubectl("delete", "isvc", "broken")


# ---- issue 17: the admin-token Secret and the NetworkPolicy, through the real operator
def test_admin_token_secret_is_created_once_owned_and_never_logged_and_a_networkpolicy_guards_the_pods(
        cluster, kubectl, operator):
    obj = wait_for(lambda: ready(kubectl, "smollm2"), what="smollm2 Ready")
    secret = kubectl.json("get", "secret", "smollm2-admin-token")
    token = secret["data"]["token"]
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [obj["metadata"]["uid"]]
    policy = kubectl.json("get", "networkpolicy", "smollm2")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    # another reconcile (a spec change) keeps the same token
    kubectl("patch", "isvc", "smollm2", "--type", "merge", "-p", json.dumps({"spec": {"engine": {"seed": 5}}}))
    wait_for(lambda: (o := ready(kubectl, "smollm2")) and "5" in o["status"]["appliedEngineArgs"], what="rollout")
    assert kubectl.json("get", "secret", "smollm2-admin-token")["data"]["token"] == token
    import base64

    plain = base64.b64decode(token).decode()
    assert plain not in operator.log.read_text() and plain not in json.dumps(kubectl.json("get", "isvc", "smollm2"))


def writes_to_children(cluster, release) -> list[tuple[str, str]]:
    """The operator's writes (update, patch, create) to children, from the API server's audit log."""
    return [(e["verb"], e["requestURI"]) for e in cluster.requests(release.username)
            if e["verb"] in ("update", "patch", "create")
            and (e.get("objectRef") or {}).get("resource") in ("deployments", "services", "configmaps")]


def test_a_create_costs_one_event_and_one_kopf_patch(cluster, kubectl, operator, release):
    """What creating one resource costs the operator in writes (issue 42: at 1,000 each one
    counts): one Event for all its children, one PATCH of Kopf's progress (its handlers for the
    create, ours and the tuner's, run in one reaction), and status writes (as many as the
    Deployment shows states and the watch's lag repeats: not counted here)."""
    kubectl.apply(manifest("counted"))
    wait_for(lambda: ready(kubectl, "counted"), what="counted Ready")
    time.sleep(2)  # the last status write's followers, if any
    isvc = [(e["verb"], ref.get("subresource", "")) for e in cluster.requests(release.username)
            if (ref := e.get("objectRef") or {}).get("resource") == "inferenceservices"
            and ref.get("name") == "counted" and e["verb"] in ("patch", "update")]
    assert isvc.count(("patch", "")) == 1, isvc  # Kopf's progress and last-handled configuration
    assert ("patch", "status") in isvc, isvc
    events = [e for e in kubectl.json("get", "events", "--field-selector", "involvedObject.name=counted")["items"]
              if e["reason"] == "Created"]
    assert len(events) == 1 and all(f"created {kind}" in events[0]["message"]
                                    for kind in ("ConfigMap", "Deployment", "Service", "Secret")), events
    kubectl("delete", "isvc", "counted")


def test_quantities_the_api_server_rewrites_are_not_drift(cluster, kubectl, operator, release):
    """The API server stores cpu "0.5" as "500m" and the GPU count 1 as "1" (canonical
    Quantity): three resyncs later the operator has patched nothing and posted no event."""
    doc = yaml.safe_load(manifest("quantities"))
    doc["spec"]["resources"] = {"cpu": "0.5", "memory": "1.5Gi", "gpu": True}
    kubectl.apply(yaml.safe_dump(doc))
    wait_for(lambda: ready(kubectl, "quantities"), what="quantities Ready")
    limits = children(cluster, "quantities")["deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "500m", "memory": "1536Mi", "nvidia.com/gpu": "1"}
    time.sleep(1.5)  # let the creation's own follow-ups settle
    writes = len(writes_to_children(cluster, release))
    seen = {e["metadata"]["uid"] for e in kubectl.json("get", "events")["items"]}
    time.sleep(3.5)  # KVPILOT_RESYNC_SECONDS=1 in the tests: at least three resyncs
    assert writes_to_children(cluster, release)[writes:] == []
    new = [e for e in kubectl.json("get", "events")["items"] if e["metadata"]["uid"] not in seen
           and e["involvedObject"]["name"] == "quantities"]
    assert new == []
    kubectl("delete", "isvc", "quantities")


def test_deleting_a_resource_needs_no_running_operator(cluster, kubectl, operator):
    """No finalizer: `kubectl delete isvc` completes, and the garbage collector removes the
    children, while the operator is down (e.g. after `helm uninstall`)."""
    kubectl.apply(manifest("orphaned"))
    obj = wait_for(lambda: ready(kubectl, "orphaned"), what="orphaned Ready")
    assert not obj["metadata"].get("finalizers")
    operator.stop()
    try:
        assert kubectl("delete", "isvc", "orphaned", "--timeout=15s").returncode == 0
        assert kubectl("get", "isvc", "orphaned", check=False).returncode != 0
        wait_for(lambda: all(c is None for c in children(cluster, "orphaned").values()), what="children gone")
    finally:
        operator.start()


def test_a_name_children_could_not_carry_is_refused_at_apply_time(kubectl, operator):
    result = kubectl.apply(manifest("m" * 57), check=False)
    assert result.returncode != 0
    assert "metadata.name must be a DNS-1035 label of at most 56 characters" in result.stderr
    assert kubectl.apply(manifest("m" * 56)).returncode == 0
    kubectl("delete", "isvc", "m" * 56)


def test_the_engine_serves_under_spec_model_name(cluster, kubectl, operator):
    doc = yaml.safe_load(manifest("named"))
    doc["spec"]["model"]["name"] = "support-chat"
    kubectl.apply(yaml.safe_dump(doc))
    obj = wait_for(lambda: ready(kubectl, "named"), what="named Ready")
    args = obj["status"]["appliedEngineArgs"]
    assert args[args.index("--served-model-name") + 1] == "support-chat"
    labels = children(cluster, "named")["deployment"]["metadata"]["labels"]
    assert labels["kvpilot.dev/model"] == "support-chat"
    kubectl("delete", "isvc", "named")


def chart_docs(*sets: str) -> list[dict]:
    return helm_template("--set=watch.namespaces={default}", *sets)


def sent_accesses(cluster, release) -> set[Access]:
    return {a for e in cluster.requests(release.username) if (a := access_of(e)) is not None}


def test_the_api_server_granted_every_request_the_operator_sent_as_the_charts_service_account(
        cluster, operator, release):
    """The operator ran with the credentials of the ServiceAccount `helm install` created, so
    the API server checked each request against the chart's Roles and ClusterRoles: none was
    refused, and this module's tests made it use every kind of access it needs."""
    events = cluster.requests(release.username)
    denied = [(e["verb"], e["requestURI"]) for e in events if e.get("responseStatus", {}).get("code") == 403]
    assert denied == []
    resources = {a.resource for a in sent_accesses(cluster, release)}
    assert {"inferenceservices", "inferenceservices/status", "deployments", "services", "configmaps",
            "events", "customresourcedefinitions", "secrets", "networkpolicies", "leases"} <= resources, resources
    # in the release namespace too: the Lease's Role is there (here it is also the watched one)
    assert [str(a) for a in missing(sent_accesses(cluster, release), helm_template(
        f"--set=watch.namespaces={{{cluster.namespace}}}", f"--namespace={cluster.namespace}"))] == []


def test_the_api_server_refuses_the_operator_once_a_verb_it_needs_is_taken_from_its_role(
        cluster, kubectl, operator, release):
    """RBAC as enforced: without `patch` on deployments in the chart's Role, repairing a
    hand-edited Deployment is refused with 403; with the Role restored, the repair goes through."""
    wait_for(lambda: ready(kubectl, "smollm2"))
    role = kubectl.json("get", "role", release.service_account)
    rule = next(r for r in role["rules"] if "deployments" in r["resources"])
    original = list(rule["verbs"])
    rule["verbs"] = [v for v in original if v not in ("patch", "update")]
    for key in ("resourceVersion", "managedFields", "uid", "creationTimestamp"):
        role["metadata"].pop(key, None)
    kubectl("replace", "-f", "-", stdin=json.dumps(role))
    try:
        kubectl("patch", "deployment", "smollm2", "--type", "merge", "-p", json.dumps(
            {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "evil:latest"}]}}}}))

        def refused() -> list:
            return [e for e in cluster.requests(release.username) if e.get("responseStatus", {}).get("code") == 403
                    and e["objectRef"].get("resource") == "deployments" and e["verb"] in ("patch", "update")]
        wait_for(refused, what="a 403 for the operator's Deployment repair")
    finally:
        rule["verbs"] = original
        kubectl("replace", "-f", "-", stdin=json.dumps(role))
    wait_for(lambda: children(cluster, "smollm2")["deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
             == "kvpilot/engine-cpu:0.1.0", what="the Deployment repaired")


def test_chart_grants_the_tuner_journal_and_kopf_peering():
    """Static check of what this module's run does not exercise: the tuner's study journal
    (GET, POST, PUT on configmaps) and Kopf peering when `peering` is set."""
    tuner = {Access("get", "", "configmaps", "default"), Access("create", "", "configmaps", "default"),
             Access("update", "", "configmaps", "default"), Access("patch", "kvpilot.dev", "inferenceservices/status", "default"),
             Access("patch", "kvpilot.dev", "inferenceservices", "default")}
    assert missing(tuner, chart_docs()) == []
    peering = {Access(v, "kopf.dev", "kopfpeerings", "default") for v in ("get", "list", "watch", "patch")}
    assert missing(peering, chart_docs()) == sorted(peering)
    assert missing(peering, chart_docs("--set=peering=kvpilot")) == []
    cluster_peering = {Access(v, "kopf.dev", "clusterkopfpeerings", None) for v in ("get", "list", "watch", "patch")}
    assert missing(cluster_peering, chart_docs("--set=peering=kvpilot", "--set=watch.clusterWide=true")) == []
    rules = [r for d in chart_docs("--set=peering=kvpilot") if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)


def test_the_operator_serves_the_tuner_metrics_the_chart_scrapes(operator):
    """The chart's command line (--tuner --metrics-port) serves the kvpilot_tuning_* and kvpilot_slo_* families, and
    the chart points a Service with scrape annotations (and, optionally, a PodMonitor) at them."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "# TYPE kvpilot_tuning_trial gauge" in text and "# TYPE kvpilot_tuning_best_objective gauge" in text
    assert "# TYPE kvpilot_slo_ttft_p95_seconds gauge" in text
    # issue 42: the operator's own families on the same port, from what it reconciled and watched
    assert "# TYPE kvpilot_operator_reconcile_duration_seconds histogram" in text
    assert 'kvpilot_operator_reconcile_duration_seconds_count{handler="create"}' in text
    ready = (f'kvpilot_operator_inferenceservice_condition{{condition="Ready",inferenceservice="smollm2",'
             f'namespace="{operator.env["KVPILOT_OPERATOR_NAMESPACE"]}",status="true"}} 1.0')
    assert ready in text
    assert f'kvpilot_operator_is_leader{{lease="{lease_name(operator)}"}} 1.0' in text
    docs = chart_docs("--set=metrics.podMonitor=true")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "kv-kvpilot-metrics")
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports["metrics"] == 9090 and "--metrics-port=9090" in pod["spec"]["containers"][0]["args"]
    monitor = next(d for d in docs if d["kind"] == "PodMonitor" and d["metadata"]["name"].endswith("-operator"))
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True}]
    assert not [d for d in chart_docs("--set=metrics.enabled=false") if d["metadata"]["name"].endswith("-metrics")]
    untuned = next(d for d in chart_docs("--set=tuner.enabled=false") if d["kind"] == "Deployment")
    assert "--metrics-port=9090" in untuned["spec"]["template"]["spec"]["containers"][0]["args"]  # the operator's own
