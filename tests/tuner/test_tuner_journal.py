"""The study kept in a ConfigMap on a real API server (tests/kube): a restarted tuner (new client, new
process state) resumes with every trial; the ConfigMap is owned by the InferenceService."""
from __future__ import annotations

import base64
import gzip

import optuna
import yaml
from kube.tools import ROOT, Kubectl, wait_for
from synthetic import SyntheticRunner

from kvpilot.engine.memory import GiB
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.cluster.journal import KEY, ConfigMapJournal, configmap_storage
from kvpilot.api.kube import KubeClient
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study


def run(kube, isvc, n_trials):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study("resume", configmap_storage(kube, isvc))
    Tuner(study, SearchSpace(max_num_seqs=(2, 64)), EngineSettings(max_model_len=1024, max_num_seqs=32),
          resolve_model("smollm2-135m-instruct"), Hardware(64 * GiB), SLO(), SyntheticRunner(),
          TunerConfig(n_trials=n_trials, remeasure_top=0)).run()
    return study


def test_study_in_a_configmap_survives_a_restart_and_goes_with_its_owner(cluster):
    kubectl = Kubectl(cluster.kubeconfig)
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"))
    kubectl("wait", "--for=condition=Established", "crd/inferenceservices.kvpilot.dev")
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    kubectl.apply(yaml.safe_dump(doc))
    first = KubeClient.from_environment(str(cluster.kubeconfig))
    isvc = first.get_isvc(cluster.namespace, "smollm2")
    assert len(run(first, isvc, 3).trials) >= 3
    first.close()

    second = KubeClient.from_environment(str(cluster.kubeconfig))  # "a restarted tuner"
    study = run(second, isvc, 5)
    numbers = [t.number for t in study.trials]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 5
    assert sum(t.user_attrs.get("is_defaults", False) for t in study.trials) == 1  # not enqueued twice

    cm = kubectl.json("get", "configmap", "smollm2-tuning")
    assert [r["uid"] for r in cm["metadata"]["ownerReferences"]] == [isvc["metadata"]["uid"]]
    lines = gzip.decompress(base64.b64decode(cm["binaryData"][KEY])).decode().splitlines()
    assert len(lines) == len(list(ConfigMapJournal(second, cluster.namespace, "smollm2-tuning").read_logs(0)))

    kubectl("delete", "isvc", "smollm2")
    wait_for(lambda: kubectl("get", "configmap", "smollm2-tuning", check=False).returncode != 0,
             what="the journal ConfigMap garbage-collected")
