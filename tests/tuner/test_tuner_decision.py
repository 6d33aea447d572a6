"""Noise-aware decisions on synthetic measurements: a trial's figure is the median of
repeated windows when they disagree, the best few and the incumbent are measured again,
and the running settings are replaced only beyond the measured spread."""
from __future__ import annotations

import optuna
import pytest
from synthetic import NoisyRunner

from kvpilot.engine.memory import GiB
from kvpilot.tuner.report import tuning_report as report
from kvpilot.tuner.search.decision import decide, relative_spread, window_figure
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study

optuna.logging.set_verbosity(optuna.logging.WARNING)
SMOL = resolve_model("smollm2-135m-instruct")
# defaults that meet the SLOs (no preemption below 48 seqs), in a space of 4 seqs values
BASE = EngineSettings(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048)
SPACE = SearchSpace(max_num_batched_tokens=None, max_num_seqs=(4, 32), max_num_seqs_pow2=True)
SLOS = SLO(ttft_p95_ms=1000, itl_p95_ms=200, max_preemptions_per_min=0)


def windows(*goodputs):
    it = iter(goodputs)
    return lambda: Measurement(duration_s=10, completed=10, goodput_rps=next(it))


def test_a_wide_spread_takes_the_median_of_more_windows_a_narrow_one_stops_at_two():
    m, figures = window_figure(windows(1.0, 2.0, 1.1, 9.0), lambda m: m.goodput_rps, max_windows=3, wide=0.15)
    assert figures == [1.0, 2.0, 1.1] and m.goodput_rps == 1.1  # the median window, the outlier 2.0 dropped
    m, figures = window_figure(windows(1.0, 1.05, 9.0), lambda m: m.goodput_rps, max_windows=3, wide=0.15)
    assert figures == [1.0, 1.05] and m.goodput_rps == 1.0
    assert window_figure(windows(5.0), lambda m: m.goodput_rps, max_windows=1, wide=0.15)[1] == [5.0]
    assert relative_spread([1.0, 2.0, 1.1]) == pytest.approx(1.0 / 1.1)


def test_replace_only_beyond_the_spread():
    inc = {"number": 0, "runs": [1.0, 1.6], "feasible": True}
    assert not decide({"number": 5, "runs": [1.4, 1.7]}, inc).replace  # margin 0.25 < noise 0.6 / 2
    d = decide({"number": 5, "runs": [1.7, 1.8]}, inc)
    assert d.replace and d.margin == pytest.approx(0.45) and d.noise == pytest.approx(0.3)
    single = decide({"number": 5, "runs": [3.0]}, {"number": 0, "runs": [1.0], "feasible": True})
    assert single.replace and single.noise is None and "no spread" in single.reason  # re-measurements off
    assert decide({"number": 5, "runs": [1.01]}, {"number": 0, "runs": [2.0], "feasible": False}).replace
    assert not decide(None, inc).replace
    # minimising: lower is better
    assert decide({"number": 5, "runs": [1.0, 1.1]}, {"number": 0, "runs": [2.0, 2.2], "feasible": True},
                  maximize=False).replace


def run(noise, gain, **config):
    study = open_study("noise", None, sampler="random", seed=1)
    runner = NoisyRunner(noise, gain)
    Tuner(study, SPACE, BASE, SMOL, Hardware(64 * GiB), SLOS, runner,
          TunerConfig(n_trials=4, remeasure_top=1, max_windows=3, max_asks=30, **config)).run()
    return study, report.build(study, SLOS, "goodput"), runner


NOISE = [1.0, 1.4, 0.8, 1.1, 0.9, 1.3, 0.7, 1.2]  # +-30%: the shared machine's windows


@pytest.mark.parametrize("shift", [0, 3, 5])
def test_a_lucky_window_does_not_replace_the_running_settings(shift):
    # the synthetic goodput grows with log2(1 + seqs): flatten it so every setting is as good as the defaults
    flat = {4: 50.44 / 23.22, 8: 50.44 / 31.70, 16: 50.44 / 40.87, 32: 1.0}
    study, rep, _ = run(NOISE[shift:] + NOISE[:shift], flat)
    for t in study.trials:
        if t.user_attrs.get("verdict") == "measured":
            assert len(t.user_attrs["window_values"]) >= 2 and "window_spread" in t.user_attrs
    assert any(len(t.user_attrs.get("window_values", ())) == 3 for t in study.trials)  # a wide pair got a third
    defaults = next(r for r in rep["ranking"] if r["number"] == 0)
    assert len(defaults["runs"]) >= 4, "the incumbent is measured again, so its spread is known"
    d = rep["decision"]
    assert not d["replace"], d
    if d["winner"] != d["incumbent"]:  # a noisy window ranked another setting first: within the spread
        assert d["noise"] > 0 and d["margin"] <= d["noise"], d
    assert "keep the running settings" in report.table(rep)


def test_a_clearly_better_setting_replaces_the_running_settings():
    study, rep, _ = run(NOISE, {4: 3.0, 8: 3.0, 16: 3.0})  # anything but the defaults serves 3x more
    d = rep["decision"]
    assert d["replace"] and d["winner"] != 0 and d["margin"] > d["noise"] > 0, d
    assert rep["best"]["spread"] > 0 and "deploy trial #" in report.table(rep)


def test_a_single_lucky_window_does_not_beat_a_re_measured_trial():
    # trial 1 looked best in its first window and regressed when measured again (winner's
    # curse); trial 2, measured once after it, sits just above the re-measured median
    ranked = [{"number": 2, "median": 1.05, "feasible": True, "measurements": 1},
              {"number": 1, "median": 1.02, "feasible": True, "measurements": 2},
              {"number": 0, "median": 0.90, "feasible": False, "measurements": 2}]
    assert report.winner(ranked)["number"] == 1
    # without any re-measurement the ranking's top wins; nothing feasible: no winner
    assert report.winner([dict(r, measurements=1) for r in ranked])["number"] == 2
    assert report.winner([dict(r, feasible=False) for r in ranked]) is None
