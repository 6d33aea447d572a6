"""Continuous tuning in a cluster, end to end on the real node (issue 50, item 4): the chart's
operator pod runs the tuner daemon (tests/kube/tuning_stack.py `tuning_operator`, a real
Prometheus scraping the engine pods), and an InferenceService asks for `spec.tuning.mode:
continuous` on live traffic. A load pod in the cluster (the engine image's `kvpilot bench
serve`, the API key from the Secret through OPENAI_API_KEY, never on a command line) sends
short random prompts (phase A) until the tuner has run study 0 and watches; a second load
pod then sends prompts eight times longer (phase B). The tuner sees the shape move (or the
SLOs break), posts a Warning Event with the figures, sets the `Tuning` condition, counts the
re-tune, runs study `<base>-1` seeded from the journal ConfigMap and goes back to Watching;
the operator's own conditions survive the tuner's condition writes. The SLOs are loose: the
test checks the mechanism, not this node's speed."""
from __future__ import annotations

import base64
import gzip
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import optuna
import pytest
import yaml
from kube.pods import POD_START_TIMEOUT_S
from kube.podman import VERSION
from kube.tools import ROOT
from kube.tuning_stack import ready, tuner_pod, tuning_operator
from optuna.storages.journal import JournalFileBackend, JournalStorage

pytestmark = pytest.mark.slow
T = TypeVar("T")
NAME = "watched"
API_KEY = "continuous-e2e-key-0123456789"
MODEL = "smollm2-135m-instruct"
ENGINE_IMAGE = f"docker.io/kvpilot/engine-cpu:{VERSION}"  # the chart's default engine image (make images)
TRIGGERS = ("WorkloadShifted", "SLOBreached")
RATE = 3.0  # requests/s: about 30 finished requests per 10 s window (the watcher judges >= 10)
# Two points in the search space (max_num_batched_tokens 256 or 512): study 1's second trial can
# roll out a real change; study 0 (maxTrials 1) runs only the spec as it is.
TUNER_ARGS = ["--max-num-batched-tokens", "256:512", "--max-num-seqs", "8:8", "--chunked-prefill", "on",
              "--remeasure-top", "0", "--rollout-timeout", "240", "--report-dir", "/tmp/report"]
CONTINUOUS = {"enabled": True, "mode": "continuous", "workload": "live", "maxTrials": 1, "trialSeconds": 10,
              "watchSeconds": 10, "breachWindows": 2, "shiftRatio": 2, "cooldownSeconds": 0,
              "maxStudiesPerHour": 10, "retuneTrials": 2}


def manifest() -> str:
    """The example resource, small, with an API key, loose SLOs and continuous tuning on live traffic."""
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["engine"].update(maxModelLen=512, maxNumSeqs=8, maxNumBatchedTokens=512,
                                 extraArgs=["--num-gpu-blocks-override", "48"],
                                 apiKeySecret={"name": f"{NAME}-api-key", "key": "api-key"})
    doc["spec"]["slo"] = {"ttftP95Ms": 60000, "itlP95Ms": 5000, "maxPreemptionsPerMin": 1000}
    doc["spec"]["tuning"] = dict(CONTINUOUS)
    return yaml.safe_dump(doc)


def load_pod(name: str, input_len: int, seconds: float) -> str:
    """A pod sending random prompts of `input_len` tokens (16 output tokens) to the Service at RATE
    for about `seconds`, with the engine's key from the Secret in OPENAI_API_KEY."""
    command = ["kvpilot", "bench", "serve", "--base-url", f"http://{NAME}:8000", "--model", MODEL,
               "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", "16",
               "--request-rate", str(RATE), "--num-prompts", str(int(RATE * seconds)), "--seed", str(input_len),
               "--request-timeout", "120", "--disable-tqdm"]
    container = {"name": "load", "image": ENGINE_IMAGE, "imagePullPolicy": "IfNotPresent", "command": command,
                 "env": [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": f"{NAME}-api-key",
                                                                                   "key": "api-key"}}},
                         {"name": "HOME", "value": "/tmp"}],
                 "resources": {"requests": {"cpu": "10m", "memory": "256Mi"}},
                 "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}]}
    return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"role": "load"}},
                           "spec": spec})


def poll(check: Callable[[], T], timeout: float, what: str, every: float = 1.0) -> T:
    """check() until truthy (every `every` s: each kubectl call costs CPU the engine needs);
    fails the test after `timeout` s with the last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, IndexError, TypeError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def journal_studies(configmap: dict[str, Any], workdir: Path) -> dict[str, optuna.Study]:
    """The studies of the journal ConfigMap (tuner/cluster/journal.py: gzip JSON lines in binaryData),
    read through Optuna's own journal storage over a copy of the log."""
    text = gzip.decompress(base64.b64decode(configmap["binaryData"]["journal.jsonl.gz"])).decode()
    path = workdir / "journal.log"
    path.write_text(text + "\n")
    storage = JournalStorage(JournalFileBackend(str(path)))
    return {s.study_name: optuna.load_study(study_name=s.study_name, storage=storage)
            for s in optuna.get_all_study_summaries(storage)}


class Watch:
    """Every distinct status.tuning.watch and every Tuning condition seen while polling."""

    def __init__(self, kubectl):
        self.kubectl, self.windows, self.tuning_conditions = kubectl, [], []

    def get(self) -> dict[str, Any]:
        obj = self.kubectl.json("get", "isvc", NAME)
        watch = obj.get("status", {}).get("tuning", {}).get("watch")
        if watch and (not self.windows or self.windows[-1] != watch):
            self.windows.append(watch)
        cond = conditions(obj).get("Tuning")
        if cond and (not self.tuning_conditions or self.tuning_conditions[-1] != cond):
            self.tuning_conditions.append(cond)
        return obj

    def judged(self) -> list[dict[str, Any]]:
        """Windows with enough finished requests to be judged (the watcher's min_requests, 10)."""
        return [w for w in self.windows if (w.get("shape") or {}).get("requests", 0) >= 10]


def test_a_workload_shift_in_the_cluster_starts_a_seeded_retune_and_watching_resumes(node, tmp_path):
    start = time.monotonic()
    with tuning_operator(node, tmp_path, TUNER_ARGS, "tuner-continuous-e2e", NAME, API_KEY) as (
            cluster, kubectl, release, _):
        kubectl.apply(manifest())
        # phase A from the start, so that study 0's one trial (live: it observes trialSeconds) has traffic;
        # until the engine is Ready its requests fail at once (a Service without endpoints)
        kubectl.apply(load_pod("load-a", 32, 900))
        first = poll(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, "the InferenceService Ready")
        seen = Watch(kubectl)
        # study 0: one trial on the spec as it is, then phase Watching; the watcher's reference is the
        # median of its first 3 judged windows (WatchConfig.reference_windows), all of phase A
        poll(lambda: seen.get()["status"]["tuning"]["phase"] == "Watching" and len(seen.judged()) >= 3, 240,
             "phase Watching with three judged windows of phase A")
        phase_a = seen.judged()[-1]
        shift_at = time.monotonic()
        kubectl.apply(load_pod("load-b", 256, 600))
        kubectl("delete", "pod", "load-a", "--wait=false")
        event = poll(lambda: next((e for e in kubectl.json("get", "events", "--field-selector",
                                                           f"involvedObject.name={NAME}")["items"]
                                   if e["reason"] in TRIGGERS), None), 150, "a WorkloadShifted / SLOBreached event")
        detected_s = time.monotonic() - shift_at
        during = poll(lambda: (o := seen.get())["status"]["tuning"].get("study") == 1 and o, 60,
                      "status.tuning.study 1")
        # the re-tune study ends when it has deployed its outcome: Watching again, Tuning False
        after = poll(lambda: (o := seen.get())["status"]["tuning"]["phase"] == "Watching"
                     and conditions(o).get("Tuning", {}).get("status") == "False"
                     and conditions(o)["Tuning"].get("reason") == "Watching"
                     and any(c["status"] == "True" for c in seen.tuning_conditions)
                     and o, 420, "phase Watching again after study 1")
        final = poll(lambda: ready(kubectl, NAME), POD_START_TIMEOUT_S, "the InferenceService Ready after study 1")
        journal = kubectl.json("get", "configmap", f"{NAME}-tuning")
        in_pod = tuner_pod(kubectl, release)
        metrics = kubectl("exec", in_pod, "--", "python", "-c", "import urllib.request as u; print(u.urlopen("
                          "'http://127.0.0.1:9090/metrics').read().decode())").stdout
        operator_log = kubectl("logs", in_pod).stdout
        load_log = kubectl("logs", "load-b", check=False).stdout
        kubectl("delete", "pod", "load-b", "--wait=false")
    duration = time.monotonic() - start
    print(f"\ncontinuous tuning e2e: {duration:.0f} s in the test (detection {detected_s:.0f} s after phase B "
          f"started), {len(seen.windows)} watch windows seen; trigger: {event['message']}; re-tune trials: "
          f"{[(h['trial'], h['maxNumBatchedTokens'], h['verdict']) for h in after['status']['tuning']['history']]}")

    tuning = during["status"]["tuning"]
    assert (event["type"], event["reason"]) in {("Warning", r) for r in TRIGGERS}, operator_log[-3000:]
    assert tuning["trigger"]["reason"] == event["reason"]
    if event["reason"] == "WorkloadShifted":  # the figures: the tuned-on prompt lengths and the ones now
        assert "prompt_tokens_p50" in event["message"] and " -> " in event["message"], event["message"]
    else:
        assert "SLOs broken" in event["message"], event["message"]
    assert tuning["trigger"]["message"] == event["message"][:1000]
    # while the study ran the Tuning condition said why; then it went back to Watching
    statuses = [(c["status"], c["reason"]) for c in seen.tuning_conditions]
    assert statuses[0] == ("False", "Watching") and ("True", event["reason"]) in statuses, statuses
    triggered = next(c for c in seen.tuning_conditions if c["status"] == "True")
    assert triggered["message"] == event["message"][:1000]
    assert statuses[-1] == ("False", "Watching")
    # status.tuning.watch: phase A's window carried the shape the shift is judged against
    assert phase_a["shape"]["prompt_tokens_p50"] < 64 and phase_a["shape"]["arrival_rps"] > 0, phase_a
    assert {"attainment", "breached_windows", "shifted_windows", "violations", "shape"} <= set(phase_a)
    assert after["status"]["tuning"]["study"] == 1
    # the operator's own conditions survived the tuner's writes of Tuning
    conds = conditions(final)
    assert conds["Ready"]["status"] == "True" and conds["Tuning"]["reason"] == "Watching", conds
    assert set(conditions(first)) - {"Tuning"} <= set(conds), conds
    # the re-tune was counted, by reason
    tuning_series = [line for line in metrics.splitlines() if line.startswith("kvpilot_tuning_")]
    retunes = [line for line in tuning_series if line.startswith("kvpilot_tuning_retunes_total{")
               and f'reason="{event["reason"]}"' in line and f'inferenceservice="{NAME}"' in line]
    assert len(retunes) == 1 and float(retunes[0].split()[-1]) == 1, tuning_series
    # the journal holds both studies; the re-tune's first trial came from the journal or is the baseline
    base = f"kvpilot-{cluster.namespace}-{NAME}"
    studies = journal_studies(journal, tmp_path)
    assert sorted(studies) == [base, f"{base}-1"], sorted(studies)
    assert studies[base].user_attrs["workload_shape"]["prompt_tokens_p50"] < 64
    assert studies[f"{base}-1"].user_attrs["workload_shape"]["prompt_tokens_p50"] > 128
    retune = studies[f"{base}-1"].get_trials(deepcopy=False)
    assert len(retune) >= 2, [t.user_attrs for t in retune]
    assert "seeded_from" in retune[0].user_attrs or retune[0].user_attrs.get("is_defaults"), retune[0].user_attrs
    assert any(t.user_attrs.get("is_defaults") for t in retune)
    assert "Traffic request rate" in load_log, load_log[-2000:]
    assert duration <= 300, f"the test took {duration:.0f} s (budget 300 s)"
