"""What each sampler the CLI offers (`--sampler tpe|gp|random`) actually conditions on.

Optuna's TPE reads COMPLETE and PRUNED trials and its GPSampler only COMPLETE ones
(`study._get_trials(states=...)` inside `TPESampler._sample` / `GPSampler.sample_relative`);
a FAIL trial reaches neither. These tests spy on the trials the sampler itself fetches
while it proposes, and check that failed (OOM) and infeasible (memory-model) trials are
among them, told with violated constraints and a dominated value, and that the sampler then
steers away from them."""
from __future__ import annotations

import functools

import optuna
import pytest
from optuna.trial import TrialState
from synthetic import SyntheticRunner

from kvpilot.engine.memory import GiB
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study

optuna.logging.set_verbosity(optuna.logging.WARNING)
SMOL = resolve_model("smollm2-135m-instruct")
BASE = EngineSettings(max_model_len=1024, max_num_seqs=128, max_num_batched_tokens=2048)
SLOS = SLO(ttft_p95_ms=1000, itl_p95_ms=200, max_preemptions_per_min=0)
# budgets 64..4096, seqs 2..256 (powers of two): budget < seqs is refused by the memory model
SPACE = SearchSpace(max_num_batched_tokens=(64, 4096), max_num_seqs=(2, 256), max_num_seqs_pow2=True)
OOM_FROM = 64  # the synthetic engine runs out of memory from 64 sequences up


class SpiedStudy:
    """Records the trial numbers the sampler fetches from the study while it proposes."""

    def __init__(self, study: optuna.Study):
        self.seen: list[set[int]] = []  # per sampler call
        self.inside = False
        original = study._get_trials

        def get_trials(*args, **kwargs):
            found = original(*args, **kwargs)
            if self.inside:
                self.seen[-1].update(t.number for t in found)
            return found

        study._get_trials = get_trials
        sampler = study.sampler
        for name in ("sample_relative", "sample_independent"):
            method = getattr(sampler, name)

            def wrapped(*args, _method=method, **kwargs):
                self.inside = True
                self.seen.append(set())
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.inside = False
            setattr(sampler, name, wrapped)

    def union(self) -> set[int]:
        return set().union(*self.seen) if self.seen else set()


@functools.cache  # one session per sampler, shared by the tests (the GP is slow)
def run(sampler: str, seed: int = 0):
    study = open_study(f"spy-{sampler}", None, sampler=sampler, seed=seed)
    spy = SpiedStudy(study)
    runner = SyntheticRunner(fail={s: "out_of_memory" for s in (64, 128, 256)})
    Tuner(study, SPACE, BASE, SMOL, Hardware(64 * GiB), SLOS, runner,
          TunerConfig(n_trials=10, remeasure_top=0, max_asks=24)).run()
    return study, spy, runner


def by_verdict(study, *verdicts):
    return [t for t in study.trials if t.user_attrs.get("verdict") in verdicts]


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_failed_and_infeasible_trials_are_among_what_the_sampler_conditions_on(sampler):
    study, spy, _ = run(sampler)
    failed = by_verdict(study, "failed", "known_failure")
    pruned = by_verdict(study, "pruned")
    assert failed and pruned, "the defaults (128 seqs) fail and budget < seqs is refused"
    last = study.trials[-1].number
    for t in failed + pruned:
        assert t.state == TrialState.COMPLETE and t.values == [0.0]
        # Trial.set_constraint: what both samplers read
        assert all(c > 0 for c in t.constraints.values()), t.constraints
        assert t.user_attrs.get("failure_kind") == "out_of_memory" or t.user_attrs.get("pruned_reason")
        if t.number < last:
            assert t.number in spy.union(), f"trial {t.number} ({t.user_attrs['verdict']}) never reached {sampler}"
    # every value told is finite and on the scale of the measurements (no 1e9 outlier for the GP)
    measured = by_verdict(study, "measured", "violates_slo")
    worst_ttft = max(t.constraints["ttft_p95_ms"] for t in measured)
    assert all(t.constraints["ttft_p95_ms"] <= max(worst_ttft, SLOS.ttft_p95_ms) for t in failed + pruned)


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_the_sampler_steers_away_from_settings_that_failed(sampler):
    study, _, runner = run(sampler)
    proposals = [t.user_attrs["settings"]["max_num_seqs"] for t in study.trials[1:]]  # after the defaults
    share_space = 3 / 8  # 64, 128, 256 of the eight powers of two
    late = proposals[len(proposals) // 2:]
    share_late = sum(s >= OOM_FROM for s in late) / len(late)
    assert share_late < share_space, (sampler, proposals)
    assert sum(s.max_num_seqs >= OOM_FROM for s in runner.calls) <= 2  # the defaults and at most one more


def test_random_search_reads_no_history_but_is_told_every_outcome():
    study, spy, _ = run("random")
    assert spy.union() == set()  # uninformed by design: nothing to steer
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert by_verdict(study, "failed", "known_failure") and by_verdict(study, "pruned")


def test_a_transient_failure_is_hidden_from_the_sampler_and_may_be_tried_again():
    study = open_study("transient", None, sampler="tpe")
    runner = SyntheticRunner(fail={2: "transient"})
    study.enqueue_trial({"max_num_seqs": 2, "max_num_batched_tokens": 2048})
    Tuner(study, SPACE, BASE, SMOL, Hardware(64 * GiB), SLOS, runner,
          TunerConfig(n_trials=2, remeasure_top=0)).run()
    first = study.trials[0]
    assert first.state == TrialState.FAIL and first.user_attrs["failure_kind"] == "transient"
