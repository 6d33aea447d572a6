"""Multi-pod InferenceServices (spec.parallelism.nnodes > 1), no cluster: the group's
StatefulSets, headless Service, client Service, NetworkPolicy, the plan that recreates a group
and rolls groups one at a time, and the status it gives."""
from __future__ import annotations

import copy

import pytest

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.operator.render.builders import HASH_ANNOTATION, build_podmonitor, build_service
from kvpilot.operator.render.group_builders import (MASTER_PORT, POD_INDEX_LABEL, build_group_children, group_hash)
from kvpilot.operator.groups import GroupPlan, plan_groups
from kvpilot.operator.render.network import NetworkPolicyConfig, build_networkpolicy
from kvpilot.operator.reconcile import OperatorConfig, desired_children
from kvpilot.operator.status import group_conditions

SMOLLM = {"source": "builtin://smollm2-135m-instruct"}
BODY = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u-1"}}


def spec(nnodes: int = 2, replicas: int = 1, **engine) -> InferenceServiceSpec:
    engine = {"pipelineParallelSize": 2, **engine}
    return InferenceServiceSpec.from_dict({"model": SMOLLM, "replicas": replicas, "engine": engine,
                                           "parallelism": {"nnodes": nnodes}})


def by_name(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def container(statefulset: dict) -> dict:
    return statefulset["spec"]["template"]["spec"]["containers"][0]


def test_one_pod_keeps_todays_deployment_service_and_policy():
    one = InferenceServiceSpec.from_dict({"model": SMOLLM})
    kinds = [c["kind"] for c in desired_children(BODY, one, OperatorConfig(), podmonitor=True)]
    assert kinds == ["ConfigMap", "Deployment", "Service", "NetworkPolicy", "PodMonitor"]
    assert build_service("m", "ns", one)["spec"]["selector"] == {
        "app.kubernetes.io/name": "kvpilot-engine", "app.kubernetes.io/instance": "m"}
    assert len(build_networkpolicy("m", "ns", one, NetworkPolicyConfig())["spec"]["ingress"]) == 1


def test_a_group_is_a_leader_statefulset_a_worker_statefulset_per_replica_and_a_headless_service():
    s = spec(nnodes=2, replicas=2)
    children = by_name(desired_children(BODY, s, OperatorConfig(), podmonitor=False))
    assert set(children) == {("ConfigMap", "m-engine"), ("Service", "m"), ("NetworkPolicy", "m"),
                             ("Service", "m-group"), ("StatefulSet", "m"), ("StatefulSet", "m-0"),
                             ("StatefulSet", "m-1")}
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == "u-1" for c in children.values())
    leader, worker = children["StatefulSet", "m"], children["StatefulSet", "m-1"]
    assert leader["spec"]["replicas"] == 2 and worker["spec"]["replicas"] == 1
    assert worker["spec"]["ordinals"] == {"start": 1} and "ordinals" not in leader["spec"]
    for sts in (leader, worker):
        assert sts["spec"]["serviceName"] == "m-group"
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    headless = children["Service", "m-group"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"].items() <= leader["spec"]["template"]["metadata"]["labels"].items()
    assert headless["selector"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    # the two workers' StatefulSets select disjoint pods, and neither selects a leader
    leader_labels = leader["spec"]["template"]["metadata"]["labels"]
    w0 = children["StatefulSet", "m-0"]["spec"]["selector"]["matchLabels"]
    assert not w0.items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    assert not w0.items() <= leader_labels.items()


def test_node_zero_serves_with_probes_and_the_workers_join_it_headless_with_their_ordinal_as_rank():
    s = spec(nnodes=3, replicas=2, tensorParallelSize=3, pipelineParallelSize=1)
    children = by_name(build_group_children("m", "ns", s))
    leader, worker = container(children["StatefulSet", "m"]), container(children["StatefulSet", "m-1"])
    env = {e["name"]: e for e in leader["env"]}
    names = [e["name"] for e in leader["env"]]
    assert names.index("POD_NAME") < names.index("LWS_LEADER_ADDRESS")  # $(POD_NAME) expands only from earlier
    assert env["LWS_LEADER_ADDRESS"]["value"] == "$(POD_NAME).m-group.ns.svc"
    assert env["LWS_GROUP_SIZE"]["value"] == "3" and env["LWS_WORKER_INDEX"]["value"] == "0"
    tail = leader["args"][-8:]
    assert tail == ["--nnodes", "3", "--node-rank", "0", "--master-addr", "$(LWS_LEADER_ADDRESS)",
                    "--master-port", str(MASTER_PORT)]
    assert {"readinessProbe", "livenessProbe", "startupProbe"} <= set(leader)
    assert [p["name"] for p in leader["ports"]] == ["http", "rendezvous"]
    wenv = {e["name"]: e for e in worker["env"]}
    assert wenv["LWS_LEADER_ADDRESS"]["value"] == "m-1.m-group.ns.svc"  # pod m-1 is node 0 of group 1
    assert wenv["LWS_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POD_INDEX_LABEL}']"
    assert worker["args"][-9:] == ["--nnodes", "3", "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr",
                                   "$(LWS_LEADER_ADDRESS)", "--master-port", str(MASTER_PORT), "--headless"]
    assert worker["ports"] == [] and not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    assert worker["args"][:-9] == leader["args"][:-8]  # the same engine, flag for flag
    assert worker["resources"] == leader["resources"]  # resources are per pod


@pytest.mark.parametrize("gpu", [True, False])
def test_runtime_vllm_renders_the_same_group_with_vllm_serve(gpu):
    """On GPUs the container runs `vllm serve` itself; on CPU nodes the launcher (from the
    ConfigMap) runs it, with the whole command line as its arguments."""
    s = InferenceServiceSpec.from_dict(
        {"model": {"source": "/models/llama"}, "engine": {"runtime": "vllm", "pipelineParallelSize": 2},
         "parallelism": {"nnodes": 2}, "resources": {"gpu": gpu}})
    children = by_name(build_group_children("m", "ns", s))
    for sts in (children["StatefulSet", "m"], children["StatefulSet", "m-0"]):
        c = container(sts)
        command = c["command"] + c["args"]
        assert command[command.index("vllm"):][:3] == ["vllm", "serve", "/models/llama"]
        assert (c["command"] == ["vllm", "serve"]) == gpu
    assert container(children["StatefulSet", "m-0"])["args"][-1] == "--headless"


def test_the_client_service_and_the_podmonitor_select_node_zero_only():
    s = spec(nnodes=2, replicas=1)
    children = by_name(build_group_children("m", "ns", s))
    leader_labels = children["StatefulSet", "m"]["spec"]["template"]["metadata"]["labels"]
    worker_labels = children["StatefulSet", "m-0"]["spec"]["template"]["metadata"]["labels"]
    for selector in (build_service("m", "ns", s)["spec"]["selector"],
                     build_podmonitor("m", "ns", s)["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= leader_labels.items() and not selector.items() <= worker_labels.items()


def test_the_networkpolicy_lets_a_groups_pods_reach_each_other_on_every_port():
    s = spec(nnodes=2)
    ingress = build_networkpolicy("m", "ns", s, NetworkPolicyConfig())["spec"]["ingress"]
    assert ingress[0]["ports"] == [{"protocol": "TCP", "port": 8000}]
    group = ingress[1]
    assert "ports" not in group  # gloo's pairs use ephemeral ports
    labels = build_group_children("m", "ns", s)[2]["spec"]["template"]["metadata"]["labels"]
    assert group["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot-engine",
                                                               "app.kubernetes.io/instance": "m"}}}]
    assert group["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()


def test_a_new_configuration_changes_every_pods_hash():
    a, b = spec(), spec(maxNumSeqs=8)
    assert group_hash("m", "ns", a) != group_hash("m", "ns", b)
    assert group_hash("m", "ns", a) != group_hash("m", "ns", spec(nnodes=1))
    for child in build_group_children("m", "ns", a):
        if child["kind"] == "StatefulSet":
            assert child["spec"]["template"]["metadata"]["annotations"][HASH_ANNOTATION] == group_hash("m", "ns", a)


def pod(name: str, group: int, role: str, digest: str = "h", ready: bool = True, restarts: int = 0,
        phase: str = "Running", deleting: bool = False) -> dict:
    labels = {"kvpilot.dev/role": role}
    labels.update({POD_INDEX_LABEL: str(group)} if role == "leader" else {"kvpilot.dev/group-index": str(group)})
    meta = {"name": name, "labels": labels, "annotations": {HASH_ANNOTATION: digest}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [{"restartCount": restarts}],
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def groups(n: int, **worker) -> list[dict]:
    return [p for g in range(n) for p in (pod(f"m-{g}", g, "leader"), pod(f"m-{g}-1", g, "worker", **worker))]


def test_every_group_whole_and_current_is_ready_and_left_alone():
    plan = plan_groups(groups(2), replicas=2, nnodes=2, digest="h")
    assert (plan.groups, plan.existing, plan.ready, plan.restart) == (2, 2, 2, {})


def test_a_member_that_restarted_or_failed_recreates_its_whole_group():
    pods = groups(2)
    pods[3] = pod("m-1-1", 1, "worker", restarts=1, ready=False)
    plan = plan_groups(pods, replicas=2, nnodes=2, digest="h")
    assert list(plan.restart) == [1] and "m-1-1 restarted" in plan.restart[1] and plan.ready == 1
    pods[3] = pod("m-1-1", 1, "worker", phase="Failed")
    assert "m-1-1 failed" in plan_groups(pods, replicas=2, nnodes=2, digest="h").restart[1]
    pods[3] = pod("m-1-1", 1, "worker", restarts=1, deleting=True)  # already being recreated
    assert plan_groups(pods, replicas=2, nnodes=2, digest="h").restart == {}


def test_a_missing_member_makes_the_group_unready_without_a_restart():
    pods = groups(2)[:3]
    plan = plan_groups(pods, replicas=2, nnodes=2, digest="h")
    assert (plan.ready, plan.existing, plan.restart) == (1, 2, {})


def test_a_rollout_replaces_one_serving_group_at_a_time_and_unready_ones_at_once():
    pods = groups(3)
    plan = plan_groups(pods, replicas=3, nnodes=2, digest="new")
    assert list(plan.restart) == [0] and plan.restart[0].endswith("run an old configuration") and plan.ready == 0
    # group 0 came back on the new configuration but is not Ready yet: nobody else goes
    rolled = [pod("m-0", 0, "leader", digest="new", ready=False), pod("m-0-1", 0, "worker", digest="new")] + pods[2:]
    assert plan_groups(rolled, replicas=3, nnodes=2, digest="new").restart == {}
    # group 0 Ready on the new configuration: the next one goes
    rolled[0] = pod("m-0", 0, "leader", digest="new")
    assert list(plan_groups(rolled, replicas=3, nnodes=2, digest="new").restart) == [1]
    # a group down anyway is replaced at once, beside the one being rolled
    down = copy.deepcopy(pods)
    down[5] = pod("m-2-1", 2, "worker", ready=False)
    assert sorted(plan_groups(down, replicas=3, nnodes=2, digest="new").restart) == [2]


@pytest.mark.parametrize("ready, restart, status, reason, degraded", [
    (1, {}, "True", "AllGroupsReady", "False"),
    (0, {0: "pod m-0-1 restarted (1 container restarts)"}, "False", "GroupsNotReady", "True"),
    (0, {0: "m-0 run an old configuration"}, "False", "GroupsNotReady", "False"),
])
def test_group_conditions_say_how_many_groups_are_ready_and_why_one_restarts(ready, restart, status, reason,
                                                                             degraded):
    conditions, replicas, ready_count = group_conditions(GroupPlan(1, 1, ready, restart), 2, "abc", 3)
    by_type = {c["type"]: c for c in conditions}
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == (status, reason)
    assert f"{ready}/1 groups of 2 pods ready" in by_type["Ready"]["message"]
    assert by_type["Degraded"]["status"] == degraded and (replicas, ready_count) == (1, ready)
    if degraded == "True":
        assert "m-0-1 restarted" in by_type["Degraded"]["message"]


def test_a_selector_with_a_key_too_many_is_drift_and_the_patch_removes_it():
    from kvpilot.operator.drift import covers, merge_patch
    group = build_service("m", "ns", spec(nnodes=2))
    one = build_service("m", "ns", spec(nnodes=1, pipelineParallelSize=1))
    actual = {**group, "metadata": {**group["metadata"], "uid": "x"}, "spec": {**group["spec"], "clusterIP": "10.0.0.9"}}
    assert covers(actual, group) and not covers(actual, one)
    patch = merge_patch(actual, one)
    assert patch["spec"]["selector"] == {**one["spec"]["selector"], "kvpilot.dev/role": None}
    assert "clusterIP" not in patch["spec"]  # only selectors are exact; defaults stay


@pytest.mark.parametrize("runtime, args", [("kvpilot", ["--nnodes", "2"]), ("kvpilot", ["--node-rank=1"]),
                                           ("kvpilot", ["--master-addr", "evil"]), ("vllm", ["--master-port=1"]),
                                           ("vllm", ["--headless"]), ("vllm", ["--node-rank", "0"])])
def test_extra_args_cannot_move_a_pod_in_its_group(runtime, args):
    from kvpilot.operator.validation import InvalidSpec, validate
    source = "/models/llama" if runtime == "vllm" else SMOLLM["source"]
    engine = {"runtime": runtime, "extraArgs": args, **({"blockSize": 128} if runtime == "vllm" else {})}
    s = InferenceServiceSpec.from_dict({"model": {"source": source}, "engine": engine})
    with pytest.raises(InvalidSpec) as refused:
        validate(s)
    assert refused.value.reason == "ConflictingArgs"


def test_each_pod_of_a_group_asks_for_the_accelerators_and_shared_memory_of_its_own_ranks():
    s = InferenceServiceSpec.from_dict({"model": {"source": "/models/llama"}, "parallelism": {"nnodes": 2},
                                        "engine": {"runtime": "vllm", "tensorParallelSize": 4, "pipelineParallelSize": 2},
                                        "resources": {"gpu": True}})
    for child in build_group_children("m", "ns", s):
        if child["kind"] == "StatefulSet":
            pod = child["spec"]["template"]["spec"]
            assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4  # 8 ranks over 2 pods
            shm = next(v for v in pod["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"]["sizeLimit"] == "7Gi"  # shm_gib(4)


def test_sync_deletes_a_broken_groups_pods_at_once_and_an_outdated_ones_with_their_grace():
    import asyncio

    from kvpilot.operator.groups import BROKEN_GROUP_GRACE_S, sync_groups

    class Kube:
        def __init__(self, pods):
            self.pods, self.deleted = pods, []

        async def list_objects(self, path, selector):
            assert path == "/api/v1/namespaces/ns/pods" and selector == "kvpilot.dev/inferenceservice=m,kvpilot.dev/role"
            return self.pods

        async def delete(self, path, propagation="Background", grace_period_s=None):
            self.deleted.append((path.rsplit("/", 1)[1], grace_period_s))
            return True

    pods = groups(2)
    pods[1] = pod("m-0-1", 0, "worker", restarts=2)
    kube = Kube(pods)
    plan = asyncio.run(sync_groups(kube, "ns", "m", 2, 2, "h"))
    assert list(plan.restart) == [0] and kube.deleted == [("m-0", BROKEN_GROUP_GRACE_S), ("m-0-1", BROKEN_GROUP_GRACE_S)]
    kube = Kube(groups(2))
    asyncio.run(sync_groups(kube, "ns", "m", 2, 2, "new"))
    assert kube.deleted == [("m-0", None), ("m-0-1", None)]  # a rollout: one group, drained
