"""The CRD as a real kube-apiserver evaluates it: every bound, enum, pattern, length and
required field of the schema, every CEL rule (x-kubernetes-validations) with its message,
defaulting and pruning, the status and scale subresources and the printer columns. Each
request is a server-side dry run (?dryRun=All): the API server validates and defaults in
full and stores nothing."""
from __future__ import annotations

import json
import urllib.error

import pytest
import yaml
from kube.schema_cases import MESSAGES, schema_cases
from kube.tools import ROOT, Kubectl, wait_for

CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
# Minimal valid parents for cases inside optional objects and list items.
PARENTS = {"spec.engine.apiKeySecret": {"name": "api-key"}, "spec.engine.env.[]": {"name": "A"}}
CASES = schema_cases(SCHEMA["properties"]["spec"], ("spec",))
# One object per CEL rule that breaks it (and only it), keyed by the rule's message start.
CEL_CASES = {
    "metadata.name must be a DNS-1035 label": {"metadata": {"name": "9lives"}},
    "runtime vllm loads builtin:// models only on CPU nodes": {"spec": {"engine": {"runtime": "vllm"},
                                                                        "resources": {"gpu": True}}},
    "enableAutoToolChoice needs toolCallParser": {"spec": {"engine": {"enableAutoToolChoice": True}}},
    "maxNumBatchedTokens must be >= maxNumSeqs": {"spec": {"engine": {"maxNumSeqs": 128, "maxNumBatchedTokens": 64}}},
    "maxNumBatchedTokens is smaller than maxModelLen with chunked prefill off":
        {"spec": {"engine": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 512}}},
    "preemptionMode swap needs swapSpace > 0": {"spec": {"engine": {"preemptionMode": "swap", "swapSpace": 0}}},
    "must be >= 16 and <= 1048576 (or -1)": {"spec": {"engine": {"maxModelLen": 8}}},
    "parallelism.nnodes must divide": {"spec": {"engine": {"tensorParallelSize": 3}, "parallelism": {"nnodes": 2}}},
    "with spec.parallelism.nnodes > 1 metadata.name must be at most 49 characters": {
        "metadata": {"name": "a" * 50}, "spec": {"engine": {"pipelineParallelSize": 2}, "parallelism": {"nnodes": 2}}},
}


def rules(schema: dict) -> list[dict]:
    found = list(schema.get("x-kubernetes-validations", []))
    for child in (schema.get("properties") or {}).values():
        found += rules(child)
    return found


def merged(base: dict, change: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in change.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.fixture(scope="module")
def create(cluster):
    Kubectl(cluster.kubeconfig)("apply", "--server-side", "-f", str(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"))
    # not `kubectl wait --for=condition=Established`: it fails at once ("accessor error: <nil>")
    # when it reads the CRD before the API server has written any condition
    established = '{.status.conditions[?(@.type=="Established")].status}'
    wait_for(lambda: Kubectl(cluster.kubeconfig)("get", "crd/inferenceservices.kvpilot.dev", "-o",
                                                 f"jsonpath={established}").stdout.strip() == "True",
             what="the CRD to be Established")
    path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices"

    def post(obj: dict, dry_run: bool = True) -> tuple[int, dict]:
        try:
            body = cluster.control_plane.api("POST", path + ("?dryRun=All&fieldValidation=Strict" if dry_run else ""), obj)
            return 201, json.loads(body)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    return post


def test_the_example_is_accepted_and_defaulted_by_the_api_server(create):
    code, stored = create(EXAMPLE)
    assert code == 201, stored
    engine = stored["spec"]["engine"]
    properties = SCHEMA["properties"]["spec"]["properties"]["engine"]["properties"]
    defaulted = {k: p["default"] for k, p in properties.items() if "default" in p and k not in EXAMPLE["spec"]["engine"]}
    assert defaulted and {k: engine[k] for k in defaulted} == defaulted


def test_every_schema_case_is_enforced_by_the_api_server(create):
    assert len(CASES) > 60
    wrong = []
    for case in CASES:
        code, answer = create(case.apply(EXAMPLE, PARENTS))
        message = answer.get("message", "")
        if case.constraint:
            if code != 422 or case.field not in message or MESSAGES[case.constraint] not in message:
                wrong.append((case.field, case.constraint, code, message))
        elif f"{case.field} in body" in message:  # the bound itself passes the schema (CEL may still refuse)
            wrong.append((case.field, "bound", code, message))
    assert wrong == []


def test_every_cel_rule_is_enforced_with_its_message(create):
    messages = [r["message"] for r in rules(SCHEMA)]
    assert sorted(m for m in messages if not any(m.startswith(k) for k in CEL_CASES)) == [], \
        "a CEL rule without a case in CEL_CASES"
    for start, change in CEL_CASES.items():
        code, answer = create(merged(EXAMPLE, change))
        assert code == 422 and start in answer["message"], (start, answer)


def test_a_name_of_56_characters_passes_and_57_do_not(create):
    assert create(merged(EXAMPLE, {"metadata": {"name": "m" * 56}}))[0] == 201
    code, answer = create(merged(EXAMPLE, {"metadata": {"name": "m" * 57}}))
    assert code == 422 and "at most 56 characters" in answer["message"]


def test_unknown_fields_are_refused_under_strict_validation_and_pruned_otherwise(create, cluster):
    code, answer = create(merged(EXAMPLE, {"spec": {"engine": {"maxNumSeq": 8}}}))
    assert code == 400 and 'unknown field "spec.engine.maxNumSeq"' in answer["message"]
    kubectl = Kubectl(cluster.kubeconfig)
    out = kubectl("create", "--dry-run=server", "--validate=false", "-o", "json", "-f", "-",
                  stdin=json.dumps(merged(EXAMPLE, {"spec": {"engine": {"maxNumSeq": 8}}})))
    assert "maxNumSeq" not in json.loads(out.stdout)["spec"]["engine"]


def test_status_and_scale_subresources_and_printer_columns(create, cluster):
    kubectl = Kubectl(cluster.kubeconfig)
    code, created = create(merged(EXAMPLE, {"metadata": {"name": "sub"}}), dry_run=False)
    assert code == 201, created
    try:
        path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices/sub"
        # a write to the main resource ignores status; the status subresource ignores spec
        changed = merged(created, {"status": {"replicas": 5}, "spec": {"replicas": 2}})
        after = json.loads(cluster.control_plane.api("PUT", path, changed))
        assert after["spec"]["replicas"] == 2 and "status" not in after and after["metadata"]["generation"] == 2
        status = merged(after, {"status": {"replicas": 2, "readyReplicas": 2, "selector": "app=x"},
                                "spec": {"replicas": 7}})
        after = json.loads(cluster.control_plane.api("PUT", path + "/status", status))
        assert after["status"]["replicas"] == 2 and after["spec"]["replicas"] == 2
        assert after["metadata"]["generation"] == 2
        assert "scaled" in kubectl("scale", "isvc/sub", "--replicas=3").stdout
        scale = json.loads(cluster.control_plane.api("GET", path + "/scale"))
        assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["selector"]) == ("Scale", 3, "app=x")
        header = kubectl("get", "isvc", "sub").stdout.splitlines()[0].split()
        assert header == ["NAME", "READY", "REPLICAS", "URL", "TUNING", "AGE"]
    finally:
        kubectl("delete", "isvc", "sub")
