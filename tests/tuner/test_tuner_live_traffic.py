"""Live-traffic trials: a window that clearly breaks an SLO is cut short, recorded as pruned
with its partial measurement, and in a cluster the best known settings go back at once."""
from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from synthetic import SyntheticRunner

from kvpilot.engine.memory import GiB
from kvpilot.tuner.cluster.runner import KubernetesRunner
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.failures import TrialCutShort
from kvpilot.tuner.measure.trial_window import WindowMeasurer, clearly_violates
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.measure.window import Snapshot
from kvpilot.tuner.measure.workload import Workload

SLOS = SLO(ttft_p95_ms=1000, itl_p95_ms=100, max_preemptions_per_min=0)


class FakeSource:
    """Returns the given windows in turn, as a real source would as the window grows."""

    name = "fake"

    def __init__(self, windows):
        self.windows, self.calls = list(windows), 0

    def begin(self):
        return Snapshot(time_s=0)

    def measure(self, start, slo):
        self.calls += 1
        return self.windows.pop(0)


def window(completed, ttft_s, seconds=10.0, preemptions=0):
    return Measurement(duration_s=seconds, completed=completed, ttft_p95_s=ttft_s, itl_p95_s=0.05,
                       preemptions=preemptions)


def test_clear_violations_need_enough_requests_and_a_margin():
    assert not clearly_violates(window(5, 9.0), SLOS)  # too few requests to judge
    assert not clearly_violates(window(20, 1.2), SLOS)  # over the limit, within the margin
    assert clearly_violates(window(20, 2.0), SLOS)
    assert clearly_violates(window(20, 0.5, preemptions=3), SLOS)


def test_live_window_is_cut_short_at_the_first_clear_violation():
    measurer = WindowMeasurer(Workload(), None, SLOS, "m", live_seconds=0.4)
    source = FakeSource([window(3, 5.0), window(12, 3.0), window(20, 3.0), window(30, 3.0)])
    with pytest.raises(TrialCutShort) as cut:
        measurer.observe(source)
    assert source.calls == 2 and cut.value.measurement.completed == 12
    assert "ttft_p95_ms" in cut.value.reason
    fine = FakeSource([window(10, 0.5)] * 4)
    assert measurer.observe(fine).completed == 10 and fine.calls == 4


def test_cut_short_trials_are_pruned_with_their_partial_measurement():
    class CutsSlowOnes(SyntheticRunner):
        def run_trial(self, number, settings):
            m = super().run_trial(number, settings)
            if m.ttft_p95_s > 0.6:
                raise TrialCutShort(m, "SLO violation clear after 10 s of 60 s")
            return m

    study = open_study("live", None, sampler="random")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runner = CutsSlowOnes()
    Tuner(study, SearchSpace(max_num_batched_tokens=(128, 4096), max_num_seqs=(2, 64), enable_chunked_prefill=(True,)),
          EngineSettings(max_model_len=1024, max_num_seqs=16), resolve_model("smollm2-135m-instruct"),
          Hardware(64 * GiB), SLO(ttft_p95_ms=600, itl_p95_ms=200, max_preemptions_per_min=0), runner,
          TunerConfig(n_trials=8, remeasure_top=0)).run()
    cut = [t for t in study.trials if t.user_attrs.get("verdict") == "cut_short"]
    assert cut and all(t.state == TrialState.COMPLETE and t.user_attrs["measurement"]["completed"] > 0 for t in cut)
    assert len(runner.calls) == 8  # cut-short trials spent budget: they were deployed


class FakeKube:
    def __init__(self):
        self.patches, self.generation = [], 1

    def patch_isvc(self, namespace, name, patch):
        self.patches.append(patch["spec"]["engine"])
        self.generation += 1
        return {"metadata": {"generation": self.generation}}

    def get_isvc(self, namespace, name):
        engine = EngineSettings.from_engine_spec(self.patches[-1])
        args = ["kvpilot", "serve", "m", *engine.to_flags()]
        return {"metadata": {"generation": self.generation},
                "status": {"observedGeneration": self.generation, "appliedEngineArgs": args,
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    def patch_status(self, namespace, name, status):
        pass


def test_cluster_trial_cut_short_restores_the_best_known_settings_at_once():
    kube = FakeKube()
    best = EngineSettings(max_num_seqs=16)

    def measure(number, settings):
        raise TrialCutShort(window(20, 5.0), "clear")

    runner = KubernetesRunner(kube, "default", "x", measure, rollout_timeout_s=5, poll_s=0.01)
    runner.best_settings, runner.best_trial = best, 0
    with pytest.raises(TrialCutShort):
        runner.run_trial(3, EngineSettings(max_num_seqs=200))
    assert [p["maxNumSeqs"] for p in kube.patches] == [200, 16]


def test_a_config_is_confirmed_only_by_the_engines_own_report():
    from kvpilot.tuner.failures import TrialFailed

    measurer = WindowMeasurer(Workload(), None, SLOS, "m", confirm_timeout_s=0)
    reports = {"loading": Snapshot(time_s=0),
               "other": Snapshot(time_s=0, config_info={"max_num_seqs": "8"}),
               "same": Snapshot(time_s=0, config_info={"max_num_seqs": "4", "block_size": "16"})}
    for name, snap in reports.items():
        measurer.scrape = lambda url, snap=snap: type("S", (), {"snapshot": lambda self: snap})()
        if name == "same":
            assert measurer.confirm("u", EngineSettings(max_num_seqs=4)) == snap.config_info
        else:
            with pytest.raises(TrialFailed, match="other settings"):
                measurer.confirm("u", EngineSettings(max_num_seqs=4))
