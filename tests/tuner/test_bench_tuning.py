"""`kvpilot bench tuning` through the command line: a two-point grid measured on the builtin
model's engine, the strategies replayed on it, the tuner's choice confirmed live against the
defaults; the recorded results replayed from their recorded grids; bad flags exit 2 saying
what to change."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.engine.settings import BY_NAME
from kvpilot.tuner.benchmark.judge import LOOSE_MS
from kvpilot.tuner.benchmark.replay import STRATEGIES, key
from kvpilot.tuner.search.settings import EngineSettings

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tuning"
TUNING = [sys.executable, "-m", "kvpilot.cli.main", "bench", "tuning"]


def tuning(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TUNING, *args], capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_grid_replay_and_confirm_on_the_engine(tmp_path):
    grid_json, replay_json, confirm_json = (tmp_path / f"{step}.json" for step in ("grid", "replay", "confirm"))
    run = tuning("grid", BY_NAME["max_num_seqs"].flag, "2,256", "--num-requests", "2", "--output-json", str(grid_json),
                 "--log-dir", str(tmp_path / "logs"))
    assert run.returncode == 0, run.stderr[-3000:]
    table = json.loads(grid_json.read_text())
    entry = table["scenarios"]["quick"]
    defaults = EngineSettings(max_model_len=256, enable_prefix_caching=False)  # every scenario keeps it off
    assert [EngineSettings(**p["settings"]) for p in entry["points"]] == [defaults.replace(max_num_seqs=2), defaults]
    windows = [w for p in entry["points"] for w in p["windows"]]
    assert len(windows) == 2 and all(w["failed"] == 0 and len(w["ttft_s"]) == 2 for w in windows)
    # one gap per streamed chunk after the first; a token that ends inside a UTF-8 character
    # goes out with the next one (as vLLM streams), so a sampled reply may have fewer chunks
    assert all(1 <= len(gaps) <= entry["spec"]["output_len"] - 1 for w in windows for gaps in w["itl_s"])
    assert sorted(w["applied"] for w in windows) == ["live", "restart"]  # one engine, the second point live
    assert table["runs"][0]["machine"]["cpu"] and len(table["runs"][0]["machine"]["loadavg"]) == 3
    assert all(len(w["loadavg"]) == 3 for w in windows)  # kvpilot.loadgen.machine's one spelling
    assert "| on | 2 | 2048 | 1 |" in run.stdout

    run = tuning("replay", "--grid", str(grid_json), "--seeds", "2", "--output-json", str(replay_json))
    assert run.returncode == 0, run.stderr[-3000:]
    replayed = json.loads(replay_json.read_text())["quick"]
    recorded = {key(p["settings"]) for p in entry["points"]}
    for strategy in STRATEGIES:  # every choice is a recorded point, judged against the table's best
        s = replayed["strategies"][strategy]
        assert {key(c) for c in s["choices"]} <= recorded and len(s["ratios"]) == 2
        assert all(0 <= r <= 1 for r in s["ratios"])
    assert replayed["slo"]["max_preemptions_per_min"] == 0 and replayed["slo"]["ttft_p95_ms"] < LOOSE_MS
    assert replayed["spec"] == entry["spec"] and "| tuner |" in run.stdout

    # the live step compares whatever the tuner chose; here it is made to choose the 2-sequence point
    replayed["strategies"]["tuner"]["choices"] = [entry["points"][0]["settings"]] * 2
    replay_json.write_text(json.dumps({"quick": replayed}))
    run = tuning("confirm", "--replay", str(replay_json), "--output-json", str(confirm_json),
                 "--log-dir", str(tmp_path / "logs"))
    assert run.returncode == 0, run.stderr[-3000:]
    confirmed = json.loads(confirm_json.read_text())["quick"]
    assert (confirmed["chosen"]["max_num_seqs"], confirmed["defaults"]["max_num_seqs"]) == (2, 256)
    assert confirmed["chosen_by_seeds"] == "2 of the 2 seeds that replaced the defaults (of 2)"
    for label in ("defaults", "chosen"):
        (window,) = confirmed["windows"][label]
        assert window["failed"] == 0 and 0 <= window["goodput_rps"] <= window["throughput_rps"]
        assert confirmed["summary"][label]["windows_meeting_slo"] in ("0/1", "1/1")
    medians = [confirmed["summary"][label]["median_goodput_rps"] for label in ("defaults", "chosen")]
    assert confirmed["chosen_over_defaults"] == (medians[1] / medians[0] if medians[0] else None)
    assert confirmed["machine"]["cpu"] and len(confirmed["machine"]["loadavg"]) == 3


def test_the_recorded_replay_comes_back_from_the_recorded_grids(tmp_path):
    """benchmarks/results/tuning/replay.json is `replay --grid grid.json grid_itl_quiet.json
    --seeds 20`; its first two seeds come back exactly. A tuner change that moves them moves the
    published table: run the README's replay command again and update the table."""
    out = tmp_path / "replay.json"
    run = tuning("replay", "--grid", str(RESULTS / "grid.json"), str(RESULTS / "grid_itl_quiet.json"),
                 "--seeds", "2", "--output-json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    recorded, replayed = json.loads((RESULTS / "replay.json").read_text()), json.loads(out.read_text())
    for name in ("preempt", "ttft", "itl"):
        assert replayed[name]["slo"] == pytest.approx(recorded[name]["slo"])
        for strategy in STRATEGIES:
            mine, theirs = replayed[name]["strategies"][strategy], recorded[name]["strategies"][strategy]
            assert mine["ratios"] == theirs["ratios"][:2], (name, strategy)
            assert [key(c) for c in mine["choices"]] == [key(c) for c in theirs["choices"][:2]], (name, strategy)


@pytest.mark.parametrize(("args", "says"), [
    (["grid", BY_NAME["max_num_seqs"].flag, "0,4"], "--max-num-seqs [0, 4]: max_num_seqs must be >= 1"),
    (["grid", "--prompt-len", "16:300"], "HIGH + output <= --max-model-len 256"),
    (["grid", "--scenarios", "preempt,fast"], "--scenarios takes names from quick,preempt,ttft,itl"),
    (["replay", "--grid", str(RESULTS / "grid.json"), "--scenarios", "quick"], "--scenarios quick: not in the grid"),
    (["confirm", "--replay", "missing.json"], "cannot read missing.json"),
])
def test_a_bad_flag_exits_2_saying_what_to_change(args, says):
    run = tuning(*args, timeout_s=120)
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
