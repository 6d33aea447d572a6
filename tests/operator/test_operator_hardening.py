"""The control routes' admin token, profiling, the NetworkPolicy per InferenceService and the
cluster admin's field policy (images, node selectors, GPU resource names). Pure: no cluster,
except kubernetes-validate over the rendered NetworkPolicy and helm for the chart values."""
from __future__ import annotations

import base64
import json
import subprocess

import pytest
import yaml
from kube.tools import BIN
from test_operator_chart import render

from kvpilot.operator.render.builders import build_admin_secret, build_deployment
from kvpilot.operator.render.engine_args import engine_command
from kvpilot.operator.render.network import NetworkPolicyConfig, build_networkpolicy
from kvpilot.operator.policy import Policy
from kvpilot.operator.reconcile import OperatorConfig
from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.operator.validation import InvalidSpec

SMOLLM = {"source": "builtin://smollm2-135m-instruct"}


def spec(engine=None, resources=None) -> InferenceServiceSpec:
    return InferenceServiceSpec.from_dict({"model": SMOLLM, "engine": engine or {}, "resources": resources or {}})


def container(s: InferenceServiceSpec) -> dict:
    return build_deployment("a", "ns", s)["spec"]["template"]["spec"]["containers"][0]


def test_kvpilot_engines_get_admin_routes_behind_the_secret_token():
    c = container(spec())
    assert "--enable-admin-routes" in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVPILOT_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "a-admin-token", "key": "token"}
    assert "VLLM_TORCH_PROFILER_DIR" not in env  # profiling is off unless spec.engine.profiling


def test_vllm_engines_get_no_admin_flag_or_token():
    s = InferenceServiceSpec.from_dict({"model": {"source": "/m"}, "engine": {"runtime": "vllm"}})
    assert "--enable-admin-routes" not in engine_command(s)
    assert "KVPILOT_ADMIN_TOKEN" not in {e["name"] for e in container(s)["env"]}


def test_admin_secret_holds_a_fresh_random_token():
    a, b = (build_admin_secret("a", "ns", spec()) for _ in range(2))
    tokens = [base64.b64decode(x["data"]["token"]).decode() for x in (a, b)]
    assert tokens[0] != tokens[1] and min(len(t) for t in tokens) >= 32
    assert a["metadata"]["name"] == "a-admin-token" and a["type"] == "Opaque"


def test_profiling_only_through_its_field_and_into_a_capped_volume():
    c = container(spec({"profiling": True}))
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_TORCH_PROFILER_DIR"] == "/home/kvpilot/profiles"
    pod = build_deployment("a", "ns", spec({"profiling": True}))["spec"]["template"]["spec"]
    assert {"name": "profiles", "emptyDir": {"sizeLimit": "2Gi"}} in pod["volumes"]


def test_networkpolicy_admits_the_namespace_prometheus_and_the_operator_only(tmp_path):
    config = NetworkPolicyConfig(operator_namespace="kvpilot-system")
    policy = build_networkpolicy("a", "team", spec(), config)
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvpilot-engine",
                                                            "app.kubernetes.io/instance": "a"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    same_ns, prometheus, operator = rule["from"]
    assert same_ns == {"podSelector": {}}
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kvpilot-system"}}
    path = tmp_path / "netpol.yaml"
    path.write_text(yaml.safe_dump(policy))
    result = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_values_reach_the_operator_and_grant_the_verbs_it_needs():
    docs = render("networkPolicy.enabled=false", "policy.allowedImagePrefixes={reg.example/kvpilot/,reg.example/vllm/}",
                  "policy.allowedGPUResources={nvidia.com/gpu}")
    env = {e["name"]: e for e in next(d for d in docs if d["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = OperatorConfig.from_env({k: v["value"] for k, v in env.items() if "value" in v})
    assert config.network.enabled is False
    assert config.policy.allowed_image_prefixes == ("reg.example/kvpilot/", "reg.example/vllm/")
    assert config.policy.allowed_gpu_resources == ("nvidia.com/gpu",)
    assert config.network.operator_labels["app.kubernetes.io/component"] == "operator"
    assert env["KVPILOT_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert json.loads(env["KVPILOT_PROMETHEUS_PEER"]["value"])["podSelector"]
    rules = [r for d in docs if d["kind"] == "Role" for r in d["rules"]]
    assert any("secrets" in r["resources"] and set(r["verbs"]) == {"get", "create"} for r in rules)
    assert any("networkpolicies" in r["resources"] and "create" in r["verbs"] for r in rules)


@pytest.mark.parametrize("policy, field, reason", [
    (Policy(allowed_image_prefixes=("reg.example/",)), {"engine": {"image": "evil.example/miner:1"}},
     "ImageNotAllowed"),
    (Policy(allowed_image_prefixes=("reg.example/",)), {"engine": {"image": "reg.example.evil/x:1"}},
     "ImageNotAllowed"),
    (Policy(allowed_node_selectors=("pool=gpu",)), {"resources": {"nodeSelector": {"pool": "system"}}},
     "NodeSelectorNotAllowed"),
    (Policy(allowed_gpu_resources=("nvidia.com/gpu",)),
     {"resources": {"gpu": True, "gpuResourceName": "example.com/fpga"}}, "GPUResourceNotAllowed"),
])
def test_policy_refuses_fields_outside_it_with_a_reason(policy, field, reason):
    s = spec(field.get("engine"), field.get("resources"))
    with pytest.raises(InvalidSpec) as info:
        policy.check(s)
    assert info.value.reason == reason


def test_policy_admits_what_it_lists_and_an_empty_policy_admits_anything():
    s = spec({"image": "reg.example/kvpilot:1"}, {"gpu": True, "nodeSelector": {"pool": "gpu", "zone": "a"}})
    Policy(("reg.example/",), ("pool=gpu", "zone=*"), ("nvidia.com/gpu",)).check(s)
    Policy().check(spec({"image": "anything:1"}, {"nodeSelector": {"x": "y"}}))
