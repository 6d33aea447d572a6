"""The ask-and-tell loop against a synthetic engine: constraints, pruning, defaults first,
failure classification, re-measurement and resuming a killed study."""
from __future__ import annotations

import pathlib

import optuna
import pytest
from optuna.trial import TrialState
from synthetic import SyntheticRunner, measure

from kvpilot.engine.memory import GiB
from kvpilot.tuner.report import tuning_report as report
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO, slack
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study

optuna.logging.set_verbosity(optuna.logging.WARNING)
SMOL = resolve_model("smollm2-135m-instruct")
BASE = EngineSettings(max_model_len=1024, max_num_seqs=128, max_num_batched_tokens=2048)
SLOS = SLO(ttft_p95_ms=1000, itl_p95_ms=200, max_preemptions_per_min=0)
SPACE = SearchSpace(max_num_batched_tokens=(64, 4096), max_num_seqs=(2, 128))


def tuner(study, runner, n_trials=12, space=SPACE, hardware=Hardware(64 * GiB), base=BASE, **config):
    return Tuner(study, space, base, SMOL, hardware, SLOS, runner, TunerConfig(n_trials=n_trials, **config))


def test_defaults_run_first_and_the_best_meets_every_slo_and_beats_them():
    runner = SyntheticRunner()
    study = tuner(open_study("t", None), runner, n_trials=14).run()
    assert runner.calls[0] == BASE
    first = study.trials[0]
    assert first.user_attrs["is_defaults"] and first.user_attrs["settings"] == BASE.as_dict()
    # the defaults (128 seqs) preempt: infeasible under max 0 preemptions/min
    assert first.user_attrs["verdict"] == "violates_slo"
    rep = report.build(study, SLOS, "goodput")
    best = EngineSettings(**rep["best"]["settings"])
    assert all(v <= 0 for v in slack(measure(best), SLOS))
    assert rep["best"]["median"] > 0 and rep["defaults"]["feasible"] is False
    assert rep["improvement"]["best_minus_defaults"] == pytest.approx(rep["best"]["median"])
    # every measured trial that broke an SLO is marked so, and none of them is ranked
    ranked = {r["number"] for r in rep["ranking"]}
    for t in rep["trials"]:
        if t["verdict"] == "violates_slo":
            assert t["number"] not in ranked and any(c > 0 for c in t["constraints"])


def test_infeasible_settings_are_pruned_with_the_reason_and_never_run():
    runner = SyntheticRunner()
    space = SearchSpace(max_num_batched_tokens=(16, 4096), max_num_seqs=(2, 128), enable_chunked_prefill=(True, False))
    study = tuner(open_study("t", None, sampler="random"), runner, n_trials=10, space=space).run()
    pruned = [t for t in study.trials if t.user_attrs["verdict"] == "pruned"]
    assert pruned, "the random sampler should propose some budget < max_num_seqs or < max_model_len"
    for t in pruned:
        assert t.user_attrs["pruned_reason"].startswith(("engine rule:", "KV cache:"))
        assert EngineSettings(**t.user_attrs["settings"]) not in runner.calls
    for s in runner.calls:
        assert s.max_num_batched_tokens >= s.max_num_seqs
        assert s.enable_chunked_prefill or s.max_num_batched_tokens >= s.max_model_len


def test_kv_cache_misfits_are_pruned_before_running():
    runner = SyntheticRunner()
    hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=32)  # 512 tokens < max_model_len 1024
    space = SearchSpace(max_num_batched_tokens=None, max_num_seqs=(2, 64))
    study = tuner(open_study("t", None), runner, n_trials=3, space=space, hardware=hardware, max_asks=5).run()
    assert runner.calls == []
    assert all("KV blocks" in t.user_attrs["pruned_reason"] for t in study.trials)


def test_rejected_and_oom_failures_are_recorded_and_never_retried_transient_retried_once():
    runner = SyntheticRunner(fail={128: "rejected", 2: "transient"})
    space = SearchSpace(max_num_batched_tokens=None, max_num_seqs=(2, 128))
    study = open_study("t", None, sampler="random")
    study.enqueue_trial({"max_num_seqs": 2})
    study.enqueue_trial({"max_num_seqs": 128})
    tuner(study, runner, n_trials=4, space=space).run()  # enqueues the defaults (128 seqs) third
    by_number = {t.number: t for t in study.trials}
    assert by_number[0].user_attrs["failure_kind"] == "transient" and by_number[0].user_attrs["attempts"] == 2
    assert by_number[1].user_attrs["failure_kind"] == "rejected" and by_number[1].user_attrs["attempts"] == 1
    assert by_number[2].user_attrs["is_defaults"] and by_number[2].user_attrs["verdict"] == "known_failure"
    assert [s.max_num_seqs for s in runner.calls].count(128) == 1
    assert [s.max_num_seqs for s in runner.calls].count(2) == 2


def test_repeated_settings_reuse_the_measurement_and_the_best_is_measured_again():
    runner = SyntheticRunner()
    space = SearchSpace(max_num_batched_tokens=(1024, 2048), max_num_seqs=None, enable_chunked_prefill=(True,))
    base = BASE.replace(max_num_seqs=16)
    # only two distinct settings exist: the budget of 3 deployments cannot be spent
    study = tuner(open_study("t", None), runner, n_trials=3, space=space, base=base, remeasure_top=2,
                  max_asks=12).run()
    verdicts = [t.user_attrs["verdict"] for t in study.trials]
    assert verdicts.count("measured") == 2 + 2 and verdicts.count("duplicate") == 12 - 2
    again = [t for t in study.trials if "remeasure_of" in t.user_attrs]
    assert len(again) == 2
    rep = report.build(study, SLOS, "goodput")
    assert len(rep["ranking"][0]["runs"]) == 2 and rep["ranking"][0]["spread"] == 0
    # 2 deployments + 2 re-measurements, nothing else ran
    assert len(runner.calls) == 4


def test_killed_study_resumes_with_its_trials(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"

    class Killed(Exception):
        pass

    class DiesOnThird(SyntheticRunner):
        def run_trial(self, number, settings):
            if len(self.calls) == 2:
                self.calls.append(settings)
                raise Killed()  # the process dies mid-trial
            return super().run_trial(number, settings)

    first = DiesOnThird()
    with pytest.raises(Killed):
        tuner(open_study("resume", storage), first, n_trials=5).run()
    interrupted = first.calls[2]
    states = [t.state for t in optuna.load_study(study_name="resume", storage=storage).trials]
    assert states[-1] == TrialState.RUNNING and TrialState.RUNNING not in states[:-1]
    killed_number = len(states) - 1

    second = SyntheticRunner()
    study = tuner(open_study("resume", storage), second, n_trials=5, remeasure_top=0).run()
    assert second.calls[0] == interrupted  # the interrupted trial is run again first
    assert study.trials[killed_number].user_attrs["verdict"] == "interrupted"
    assert study.trials[killed_number + 1].user_attrs["settings"] == interrupted.as_dict()
    assert study.trials[0].user_attrs["is_defaults"]
    assert len(first.calls) - 1 + len(second.calls) == 5  # the budget spans both runs
    assert not any(t.user_attrs.get("is_defaults") for t in study.trials[1:])


def test_gp_sampler_and_multi_objective_pareto_front():
    runner = SyntheticRunner()
    study = tuner(open_study("gp", None, sampler="gp"), runner, n_trials=6).run()
    assert len(runner.calls) == 6 + 2  # budget plus two re-measurements
    multi = tuner(open_study("multi", None, objective="multi"), SyntheticRunner(), n_trials=8,
                  objective="multi", latency="e2e").run()
    rep = report.build(multi, SLOS, "multi")
    front = rep["pareto_front"]
    assert front and rep["best"] is None
    # along the front, more throughput costs more latency
    assert all(a["values"][1] <= b["values"][1] for a, b in zip(front, front[1:]))
    assert "Pareto front" in report.table(rep)
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE]


def test_report_table_names_pruned_reasons_and_the_defaults(tmp_path):
    space = SearchSpace(max_num_batched_tokens=(16, 4096), max_num_seqs=(2, 128))
    study = tuner(open_study("t", None, sampler="random"), SyntheticRunner(), n_trials=6, space=space).run()
    rep = report.build(study, SLOS, "goodput", meta={"model": "smollm2"})
    text = report.table(rep)
    assert "(defaults)" in text and "best: trial #" in text
    assert text.count("\n") >= len(study.trials) + 2
    path = report.write(rep, tmp_path)
    assert path.is_file() and (tmp_path / "report.txt").read_text().startswith("  #")


def test_report_folder_has_plots_and_a_tuned_manifest_the_crd_accepts(tmp_path):
    import yaml

    from kvpilot.tuner.report import artifacts
    from kvpilot.tuner.search.settings import SPEC_KEYS

    study = tuner(open_study("t", None), SyntheticRunner(), n_trials=6).run()
    rep = report.build(study, SLOS, "goodput")
    written = {p.name for p in artifacts.write_plots(tmp_path, study, rep)}
    assert {"history.png", "importances.png", "latency_cdf.png"} <= written
    assert all((tmp_path / name).stat().st_size > 1000 for name in written)
    best = EngineSettings(**rep["best"]["settings"])
    path = artifacts.write_manifest(tmp_path, artifacts.tuned_inferenceservice(
        "smollm2", "builtin://smollm2-135m-instruct", best, SLOS, extra_args=["--num-gpu-blocks-override", "64"]))
    doc = yaml.safe_load(path.read_text())
    crd_path = pathlib.Path(__file__).parents[2] / "crds" / "inferenceservices.kvpilot.dev.yaml"
    crd = yaml.safe_load(crd_path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(doc["spec"]) <= set(schema["properties"])
    assert set(doc["spec"]["engine"]) <= set(schema["properties"]["engine"]["properties"])
    assert doc["spec"]["engine"]["maxNumSeqs"] == best.max_num_seqs
    unset = {SPEC_KEYS[k] for k, v in best.as_dict().items() if v is None}  # e.g. performanceMode: no null in the CRD
    assert unset and set(SPEC_KEYS.values()) - unset <= set(doc["spec"]["engine"])
    assert not unset & set(doc["spec"]["engine"])
    import jsonschema
    jsonschema.Draft4Validator(schema).validate(doc["spec"])  # OpenAPI v3 schemas use draft-4 booleans


def test_capacity_search_finds_the_highest_rate_within_the_slos():
    from kvpilot.tuner.search.capacity import find_capacity
    from kvpilot.tuner.search.objective import Measurement

    def measure(rate):  # TTFT grows with the rate; the 1000 ms SLO breaks at 2.5 req/s
        return Measurement(duration_s=60, completed=60, ttft_p95_s=0.4 * rate, itl_p95_s=0.05)

    m = find_capacity(measure, SLOS, 0.25, 8.0, steps=4)
    rates = [r for r, _ in m.extra["capacity_probes"]]
    assert rates[:2] == [0.25, 8.0] and len(rates) == 2 + 4
    assert 2.0 <= m.capacity_rps <= 2.5 and m.ttft_p95_s == pytest.approx(0.4 * m.capacity_rps)
    assert all(ok == (r <= 2.5) for r, ok in m.extra["capacity_probes"])
    assert find_capacity(measure, SLOS, 3.0, 8.0).capacity_rps == 0.0
    assert find_capacity(measure, SLOS, 0.5, 2.0).capacity_rps == 2.0
    with pytest.raises(ValueError):
        find_capacity(measure, SLOS, 2.0, 1.0)


def test_capacity_objective_is_maximised():
    class CapacityRunner(SyntheticRunner):
        def run_trial(self, number, settings):
            m = super().run_trial(number, settings)
            m.capacity_rps = m.throughput_rps / 10
            return m

    study = tuner(open_study("cap", None, objective="capacity"), CapacityRunner(), n_trials=5,
                  objective="capacity").run()
    rep = report.build(study, SLOS, "capacity")
    best = rep["best"]
    assert best and best["median"] == pytest.approx(measure(EngineSettings(**best["settings"])).throughput_rps / 10)
