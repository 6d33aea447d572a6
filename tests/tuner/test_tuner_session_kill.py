"""issue 42: the tuner's session killed mid-trial where the operator pod runs it, with the study
where the operator pod keeps it: the InferenceService's journal ConfigMap on the real API
server (kvpilot.tuner.cluster.journal). The real tuner loop (synthetic engine, ~0.4 s a trial) runs
in a child process that is SIGKILLed inside a trial twice and then runs to the end: no trial
is left RUNNING, every interrupted trial is run again, and the study ends with exactly its
budget of deployed trials (none lost, none twice). The SQLite variant with more kills is
tests/tuner/bench_tuner_kill.py."""
from __future__ import annotations

import yaml
from bench_tuner_kill import kill_and_resume
from kube.tools import ROOT, Kubectl


def test_a_session_killed_mid_trial_twice_resumes_from_its_configmap_journal_losing_no_trial(cluster):
    kubectl = Kubectl(cluster.kubeconfig)
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/inferenceservices.kvpilot.dev")
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"]["name"] = "killed"
    kubectl.apply(yaml.safe_dump(doc))
    result = kill_and_resume(f"configmap:{cluster.kubeconfig}:{cluster.namespace}/killed", kills=2, trials=6)
    assert result["kills"] == 2 and result["final_exit"] == 0, result
    assert result["interrupted"] >= 1, result  # the kills landed inside trials
    assert result["still_running"] == 0 and result["interrupted_never_rerun"] == 0, result
    assert result["deployed"] == result["budget"] and result["deployed_beyond_budget"] == 0, result
    assert kubectl.json("get", "configmap", "killed-tuning")["binaryData"]
