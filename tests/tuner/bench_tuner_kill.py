"""Benchmark (not a test): the real tuner loop (`kvpilot.tuner.loop.Tuner`, Optuna study in
SQLite) in a child process, SIGKILLed mid-study N times and restarted each time; the engine
is the synthetic one of the loop tests, slowed to ~0.4 s a trial and each kill lands 0-0.3 s
after a new trial started RUNNING. At the end: trials still RUNNING (lost), interrupted trials never re-run (lost),
interrupted trials re-run more than once or deployed trials beyond the budget (duplicated).
Prints one JSON line.

    .venv/bin/python tests/tuner/bench_tuner_kill.py [--kills 5] [--trials 16]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def child(storage: str, trials: int) -> None:
    import optuna
    from synthetic import SyntheticRunner
    from test_tuner_loop import tuner

    from kvpilot.tuner.study import open_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    class Slow(SyntheticRunner):
        def run_trial(self, number, settings):
            time.sleep(0.4)
            return super().run_trial(number, settings)

    tuner(open_study("kill", storage), Slow(), n_trials=trials, remeasure_top=0).run()


def trials_of(storage: str) -> list:
    import optuna

    try:
        return optuna.load_study(study_name="kill", storage=storage).trials
    except KeyError:  # not created yet
        return []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.trials)
        return 0
    import optuna
    from optuna.trial import TrialState

    rng = random.Random(17)
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"sqlite:///{tmp}/study.db"
        cmd = [sys.executable, __file__, "--child", storage, "--trials", str(args.trials)]
        kills = 0
        for _ in range(args.kills):
            proc = subprocess.Popen(cmd)
            before = len(trials_of(storage))
            end = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < end:  # wait for a new trial to run
                now = trials_of(storage)
                if len(now) > before and any(t.state == TrialState.RUNNING for t in now):
                    break
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside that trial
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
        final = subprocess.run(cmd, timeout=600)
        trials = optuna.load_study(study_name="kill", storage=storage).trials
    interrupted = [t for t in trials if t.user_attrs.get("verdict") == "interrupted"]
    reruns = [sum(1 for u in trials if u.number > t.number and u.params == t.params
                  and u.user_attrs.get("verdict") != "interrupted") for t in interrupted]
    deployed = [t for t in trials if t.user_attrs.get("verdict") in ("measured", "violates_slo", "failed", "cut_short")
                and "remeasure_of" not in t.user_attrs]
    result = {"kills": kills, "final_exit": final.returncode, "trials": len(trials), "budget": args.trials,
              "deployed": len(deployed), "interrupted": len(interrupted),
              "still_running": sum(t.state == TrialState.RUNNING for t in trials),
              "interrupted_never_rerun": sum(r == 0 for r in reruns),
              "deployed_beyond_budget": max(0, len(deployed) - args.trials)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
