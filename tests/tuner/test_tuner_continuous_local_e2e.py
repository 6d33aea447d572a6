"""`kvpilot tune --local --continuous` end to end on one machine, through `kvpilot bench
retune`'s code path: the real engine (`kvpilot serve`, builtin SmolLM2, a small KV cache), live
traffic from `kvpilot bench serve` (short replies, then replies 8x longer, which two requests at once
cannot serve), the watcher on the engine's /metrics, and a re-tune seeded from the first study.
Short windows keep it near two minutes; `kvpilot bench retune`'s defaults measure it properly."""
from __future__ import annotations

import json

import pytest

from kvpilot.tuner.benchmark import retune

pytestmark = pytest.mark.slow


def test_a_shift_in_live_traffic_is_seen_and_re_tuned(tmp_path):
    argv = ["--arms", "continuous", "--phase-a", "32,16,1.5", "--phase-b", "64,128,1.2", "--phase-a-s", "60",
            "--phase-b-s", "90", "--watch-seconds", "10", "--live-seconds", "10", "--retune-trials", "3",
            "--report-dir", str(tmp_path)]
    assert retune.main(argv) == 0
    arm = json.loads((tmp_path / "retune.json").read_text())["arms"][0]
    log = (tmp_path / "continuous" / "tune.log").read_text()
    assert arm["trigger"] in ("SLOBreached", "WorkloadShifted"), log[-3000:]
    assert arm["studies"] == 2 and arm["windows_to_detection"] <= 5, (arm, log[-3000:])
    assert arm["windows_met_before"] is not None and arm["windows"][0] >= 2  # phase A was watched
    timeline = json.loads((tmp_path / "continuous" / "timeline.json").read_text())
    windows = [e for e in timeline if e["kind"] == "window"]
    assert all(w["shape"]["output_tokens_p50"] is None or w["shape"]["output_tokens_p50"] < 40
               for w in windows if w["time_s"] < timeline[0]["time_s"] + 30)  # phase A's short replies seen
    assert max(w["shape"]["output_tokens_p50"] or 0 for w in windows) > 100  # and phase B's long ones
    # each study's report; the re-tune started from the running settings (its baseline)
    studies = sorted(p.name for p in (tmp_path / "continuous").iterdir() if p.is_dir())
    assert len(studies) == 2
    report = json.loads((tmp_path / "continuous" / studies[1] / "report.json").read_text())
    assert any(t["is_defaults"] for t in report["trials"])
    assert "SLO" in log or "shifted" in log


def test_the_figures_come_from_the_timeline():
    windows = [{"kind": "window", "time_s": t, "trigger": trig, "attainment": att, "violations": v, "completed": 10,
                "preemptions": p}
               for t, trig, att, v, p in [(1, None, 1.0, {}, 0), (2, None, 1.0, {}, 0), (4, None, 0.5, {"x": 1}, 3),
                                          (5, "SLOBreached", 0.5, {"x": 1}, 3), (8, None, 1.0, {}, 0)]]
    studies = [{"kind": "study", "time_s": 0.5, "trials": 1, "deployed": {}},
               {"kind": "study", "time_s": 7, "trials": 4, "deployed": {"max_num_seqs": 2}}]
    f = retune.figures(sorted(windows + studies, key=lambda e: e["time_s"]), started_s=0.6, shift_s=3)
    assert f["windows_to_detection"] == 2 and f["trigger"] == "SLOBreached" and f["retune_trials"] == 4
    assert (f["windows_met_before"], f["windows_met_during"], f["windows_met_after"]) == (1.0, 0.0, 1.0)
    assert f["attainment_during"] == 0.5 and f["preemptions_after_shift"] == 6 and f["windows"] == [2, 2, 1]
