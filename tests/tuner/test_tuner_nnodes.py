"""One engine over several pods (spec.parallelism.nnodes, vLLM's --nnodes) in the tuner: the
memory model per pod (each pod runs world / nnodes ranks under its own resources), layouts
over pods in the space only when a range of pods is given, a trial's rollout as one patch of
spec.engine and spec.parallelism, and a pod lost during a trial (any member of a group)
failing it and putting the best settings back."""
from __future__ import annotations

import optuna
import pytest
import torch

from kvpilot.engine.config import ParallelConfig
from kvpilot.engine.memory import GiB
from kvpilot.engine.config import node_ranks
from kvpilot.tuner import cli
from kvpilot.tuner.cluster.runner import KubernetesRunner
from kvpilot.tuner.failures import TRANSIENT, TrialFailed
import dataclasses

from kvpilot.tuner.search.feasibility import Hardware, check, estimate_rank_memory, resolve_model
from kvpilot.tuner.search.objective import Measurement
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace

SMOL = resolve_model("smollm2-135m-instruct")  # 30 layers, 9 heads, 3 KV heads
# one rank of SmolLM2 in bf16 on CPU (plain + packed weights, ~0.5 GiB) and its KV for 8192 tokens fit
# in 800 MiB x 0.9; two pipeline stages in one pod add an LM-head copy and a second activation
TIGHT = EngineSettings(max_model_len=8192, max_num_batched_tokens=256, max_num_seqs=8)
CPU_POD = Hardware(800 << 20, num_devices=1, shared_memory=True, dtype=torch.bfloat16)


def test_a_pipeline_that_does_not_fit_one_pod_fits_two_pods_with_a_stage_each():
    pp2 = TIGHT.replace(pipeline_parallel_size=2)
    one_pod = check(pp2, SMOL, dataclasses.replace(CPU_POD, num_devices=2))
    assert not one_pod.feasible and "2 ranks share one memory" in one_pod.reason
    two_pods = check(pp2.replace(nnodes=2), SMOL, CPU_POD)
    assert two_pods.feasible, two_pods.reason
    # each pod pays only for the rank it runs; the pod with the fewer blocks decides
    ranks = estimate_rank_memory(pp2, SMOL, ParallelConfig(1, 2), packed_weights=True)
    per_pod = [(int((800 << 20) * 0.9) - r.weights_bytes - r.activation_bytes) // r.block_bytes for r in ranks]
    assert two_pods.num_blocks == min(per_pod)
    assert list(node_ranks(4, 2, 1)) == [2, 3]


def test_gpu_ranks_are_counted_against_the_devices_of_one_pod():
    tp3 = EngineSettings(max_model_len=1024, tensor_parallel_size=3)
    refused = check(tp3, SMOL, Hardware(16 * GiB, num_devices=1))
    assert not refused.feasible and "exceeds the 1 available device(s) of a pod" in refused.reason
    assert check(tp3.replace(nnodes=3), SMOL, Hardware(16 * GiB, num_devices=1)).feasible
    two_per_pod = check(EngineSettings(max_model_len=1024, pipeline_parallel_size=6, nnodes=3), SMOL,
                        Hardware(16 * GiB, num_devices=1))
    assert not two_per_pod.feasible and "over 3 pods is 2 ranks per pod" in two_per_pod.reason


def test_an_nnodes_that_does_not_divide_the_ranks_is_refused_with_the_reason():
    verdict = check(EngineSettings(max_model_len=1024, pipeline_parallel_size=3, nnodes=2), SMOL,
                    Hardware(16 * GiB, num_devices=4))
    assert not verdict.feasible
    assert verdict.reason.startswith("layout: nnodes 2 does not divide tensor_parallel_size x "
                                     "pipeline_parallel_size = 3")


def test_a_cpu_pod_needs_a_cpu_per_rank_it_runs():
    pp2 = EngineSettings(max_model_len=1024, pipeline_parallel_size=2)
    roomy = Hardware(16 * GiB, num_devices=2, shared_memory=True, dtype=torch.bfloat16, cpus=1.5)
    assert check(pp2, SMOL, roomy).feasible  # 2 ranks, a quota of 1.5 CPUs rounds up to 2
    small = Hardware(16 * GiB, num_devices=2, shared_memory=True, dtype=torch.bfloat16, cpus=1)
    verdict = check(pp2, SMOL, small)
    assert not verdict.feasible and "exceeds the pod's 1 CPU(s)" in verdict.reason
    assert check(pp2.replace(nnodes=2), SMOL, small).feasible


def test_layouts_over_pods_enter_the_space_only_with_a_range_of_pods():
    base = EngineSettings(max_model_len=1024)
    assert SearchSpace(parallel=True, num_devices=1).parallel_choices(SMOL, base) == ["1x1"]
    space = SearchSpace(parallel=True, num_devices=1, nnodes=(1, 3))
    # one rank per pod: pp over 2 or 3 pods (tp 3 over 3 pods too); tp 2 does not divide 9 heads
    assert space.parallel_choices(SMOL, base) == ["1x1", "1x2x2", "1x3x3", "3x1x3"]
    fixed = SearchSpace(nnodes=(1, 2), num_devices=2)  # no --parallel: the base's tp x pp over 1 or 2 pods
    assert fixed.parallel_choices(SMOL, base.replace(pipeline_parallel_size=2)) == ["1x2", "1x2x2"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(12):
        settings = space.suggest(study.ask(), base, SMOL)
        seen.add((settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.nnodes))
        assert space.params_of(settings, SMOL)["parallel"] in space.parallel_choices(SMOL, base)
    assert (1, 2, 2) in seen and (1, 1, 1) in seen
    # the base's own layout is always a choice, so it can run as trial 0 (feasibility judges it)
    assert space.parallel_choices(SMOL, base.replace(tensor_parallel_size=3))[0] == "3x1"


def test_the_tune_flag_gives_the_range_and_local_tuning_checks_the_node_flags(capsys):
    from kvpilot.tuner.local.session import searched_flags

    a = cli.parse(["--namespace", "d", "--name", "x", "--parallel", "--nnodes", "1:2"])
    assert a.space.nnodes == (1, 2)
    assert cli.parse(["--namespace", "d", "--name", "x"]).space.nnodes is None
    with pytest.raises(SystemExit) as refused:
        cli.parse(["--namespace", "d", "--name", "x", "--nnodes", "2:1"])
    assert refused.value.code == 2 and "nnodes bounds must satisfy 1 <= low <= high" in capsys.readouterr().err
    local = cli.parse(["--local", "--nnodes", "1:2"])  # the nodes run as processes here: their flags must exist
    assert {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless"} <= set(
        searched_flags(EngineSettings(), local))


def test_local_nodes_share_this_machine_and_start_as_processes(tmp_path):
    from kvpilot.tuner.local.engine_process import EngineProcess

    pp2 = TIGHT.replace(pipeline_parallel_size=2)
    machine = dataclasses.replace(CPU_POD, num_devices=2, one_machine=True)
    # two nodes on one machine hold what one node holds: the same memory for both ranks
    assert check(pp2.replace(nnodes=2), SMOL, machine) == check(pp2, SMOL, machine)
    engine = EngineProcess("m", tmp_path / "engine.log")
    engine.port, engine.master_port = 8000, 29600
    node0, node1 = (engine.command(pp2.replace(nnodes=2), rank) for rank in (0, 1))
    meet = ["--master-addr", "127.0.0.1", "--master-port", "29600"]
    assert node0[node0.index("--node-rank"):][:6] == ["--node-rank", "0", *meet]
    assert node1[node1.index("--node-rank"):][:7] == ["--node-rank", "1", *meet, "--headless"]
    assert "--port" in node0 and "--port" not in node1 and "--nnodes" in node1
    assert "--node-rank" not in engine.command(pp2)
    assert engine.node_log_path(1) == tmp_path / "engine.node1.log"


class GroupKube:
    """An InferenceService whose rollouts complete at once; `lose` makes its Ready condition
    leave True (as the operator reports a group that lost a pod) or come back with a later
    transition time."""

    def __init__(self, group_lag: int = 0):
        self.patches, self.generation = [], 1
        self.group_lag = group_lag  # polls that still report the previous group size
        self.ready = {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
        self.degraded = {"type": "Degraded", "status": "False"}

    def patch_isvc(self, namespace, name, patch):
        self.patches.append(patch)
        self.generation += 1
        return {"metadata": {"generation": self.generation}}

    def get_isvc(self, namespace, name):
        engine = EngineSettings.from_engine_spec(self.patches[-1]["spec"]["engine"])
        nnodes = self.patches[-1]["spec"]["parallelism"]["nnodes"]
        self.group_lag -= 1
        return {"metadata": {"generation": self.generation},
                "status": {"observedGeneration": self.generation, "groupSize": None if nnodes == 1 or
                           self.group_lag >= 0 else nnodes,
                           "appliedEngineArgs": ["kvpilot", "serve", "m", *engine.to_flags()],
                           "conditions": [dict(self.ready), dict(self.degraded)]}}

    def lose(self, status: str, when: str = "2026-01-01T00:05:00Z"):
        self.ready.update(status=status, lastTransitionTime=when, reason="GroupsNotReady",
                          message="0/1 groups of 2 pods ready")
        if status == "False":  # as operator/status.py's group_conditions report a group being recreated
            self.degraded.update(status="True", reason="GroupRestarting",
                                 message="group 0: pod x-0-1 restarted (1 container restarts)")

    def patch_status(self, namespace, name, status):
        self.status = status


def runner(kube, measure):
    r = KubernetesRunner(kube, "default", "x", measure, rollout_timeout_s=5, poll_s=0.01, loss_grace_s=0.2)
    r.best_settings, r.best_trial = EngineSettings(max_num_seqs=16), 0
    return r


def test_a_two_pod_trial_patches_engine_and_parallelism_in_one_generation():
    kube = GroupKube(group_lag=3)  # the operator reports the groups three polls later
    trial = EngineSettings(max_num_seqs=8, pipeline_parallel_size=2, nnodes=2)
    m = runner(kube, lambda n, s: Measurement(duration_s=10.0, completed=4)).run_trial(1, trial)
    (patch,) = kube.patches
    assert patch["spec"]["parallelism"] == {"nnodes": 2}
    assert patch["spec"]["engine"]["pipelineParallelSize"] == 2 and "nnodes" not in patch["spec"]["engine"]
    assert EngineSettings.from_spec(patch["spec"]) == trial
    assert m.extra["generation"] == 2 and kube.group_lag < 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_pod_lost_during_the_window_fails_the_trial_and_restores_the_best(fails):
    kube = GroupKube()

    def measure(number, settings):
        if fails:  # node 0 exits when a node is lost: requests fail, Ready drops
            kube.lose("False")
            raise TrialFailed(TRANSIENT, "engine unreachable during the trial: ConnectError")
        kube.lose("True")  # the group restarted and is Ready again before the window closed
        return Measurement(duration_s=10.0, completed=4)

    with pytest.raises(TrialFailed) as failed:
        runner(kube, measure).run_trial(3, EngineSettings(max_num_seqs=8, pipeline_parallel_size=2, nnodes=2))
    assert failed.value.kind == TRANSIENT and "pod was lost" in failed.value.message
    assert ("ConnectError" in failed.value.message) == fails
    assert ("pod x-0-1 restarted" in failed.value.message) == fails
    # the trial's layout, then the best known settings back at once
    assert [(p["spec"]["engine"]["maxNumSeqs"], p["spec"]["parallelism"]["nnodes"]) for p in kube.patches] == [
        (8, 2), (16, 1)]


def test_a_failed_window_without_a_lost_pod_keeps_the_trial_settings():
    kube = GroupKube()

    def measure(number, settings):
        raise TrialFailed(TRANSIENT, "measurement void, a metric has no series")

    with pytest.raises(TrialFailed, match="no series"):
        runner(kube, measure).run_trial(3, EngineSettings(max_num_seqs=8))
    assert len(kube.patches) == 1


def test_the_status_history_says_how_many_pods_each_trial_ran_on():
    kube, study = GroupKube(), optuna.create_study(direction="maximize")
    for nnodes in (1, 2):
        trial = study.ask()
        trial.set_user_attr("settings", EngineSettings(pipeline_parallel_size=2, nnodes=nnodes).as_dict())
        trial.set_user_attr("verdict", "measured")
        frozen = study.tell(trial, 1.0 + nnodes)
    runner(kube, None).record(study, frozen)
    assert [h["nnodes"] for h in kube.status["tuning"]["history"]] == [1, 2]


def test_the_story_explains_a_winner_over_more_pods():
    from kvpilot.tuner.report.story import changes

    (line,) = changes({"nnodes": 1, "max_num_seqs": 8}, {"nnodes": 2, "max_num_seqs": 8})
    assert line.startswith("raise nnodes 1 -> 2: the ranks spread over more pods")


def test_engine_flags_name_the_nodes_only_when_there_are_several():
    assert "--nnodes" not in EngineSettings().to_flags()
    flags = EngineSettings(pipeline_parallel_size=2, nnodes=2).to_flags()
    assert flags[flags.index("--nnodes") + 1] == "2"


def test_the_in_cluster_hardware_is_one_pods_resources():
    from kvpilot.api.spec import InferenceServiceSpec
    from kvpilot.tuner.cluster.session import hardware_of

    spec = InferenceServiceSpec.from_dict({"model": {"source": "builtin://smollm2-135m-instruct"},
                                           "resources": {"cpu": "500m", "memory": "2Gi"},
                                           "parallelism": {"nnodes": 2}})
    pod = hardware_of(spec, cli.parse(["--namespace", "d", "--name", "x"]))
    assert (pod.device_memory_bytes, pod.cpus, pod.shared_memory, pod.one_machine) == (2 * GiB, 0.5, True, False)
    gpus = hardware_of(spec, cli.parse(["--namespace", "d", "--name", "x", "--device-memory-gib", "80"]))
    assert gpus.cpus is None and not gpus.shared_memory
