"""Benchmark (not a test): the real tuner loop (`kvpilot.tuner.search.loop.Tuner`, Optuna study in
SQLite) in a child process, SIGKILLed mid-study N times and restarted each time; the engine
is the synthetic one of the loop tests, slowed to ~0.4 s a trial and each kill lands 0-0.3 s
after a new trial started RUNNING. At the end: trials still RUNNING (lost), interrupted trials never re-run (lost),
interrupted trials re-run more than once or deployed trials beyond the budget (duplicated).
Prints one JSON line. The study is in SQLite, or (storage `configmap:KUBECONFIG:NAMESPACE/NAME`)
in the InferenceService's journal ConfigMap as the operator pod's tuner keeps it
(kvpilot.tuner.cluster.journal): tests/tuner/test_tuner_session_kill.py runs that against the real
API server.

    .venv/bin/python tests/tuner/bench_tuner_kill.py [--kills 5] [--trials 16]
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


@functools.lru_cache(maxsize=None)  # one client and journal per storage: the polls replay only new lines
def study_storage(storage: str):
    """The Optuna storage named by `storage`: an SQLAlchemy URL, or configmap:KUBECONFIG:NS/NAME
    (the journal ConfigMap of InferenceService NS/NAME)."""
    if not storage.startswith("configmap:"):
        return storage
    from kvpilot.api.kube import KubeClient
    from kvpilot.tuner.cluster.journal import configmap_storage

    kubeconfig, resource = storage.removeprefix("configmap:").rsplit(":", 1)
    namespace, name = resource.split("/")
    kube = KubeClient.from_environment(kubeconfig, user_agent="kvpilot-tuner")
    return configmap_storage(kube, kube.get_isvc(namespace, name))


def child(storage: str, trials: int) -> None:
    import optuna
    from synthetic import SyntheticRunner
    from test_tuner_loop import tuner

    from kvpilot.tuner.search.study import open_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = study_storage(storage)

    class Slow(SyntheticRunner):
        def run_trial(self, number, settings):
            time.sleep(0.4)
            return super().run_trial(number, settings)

    tuner(open_study("kill", storage), Slow(), n_trials=trials, remeasure_top=0).run()


def trials_of(storage: str) -> list:
    import optuna

    try:
        return optuna.load_study(study_name="kill", storage=study_storage(storage)).trials
    except KeyError:  # not created yet
        return []


def kill_and_resume(storage: str, kills: int, trials: int, seed: int = 17) -> dict:
    """SIGKILL the child `kills` times inside a trial, then let one run finish; the counts."""
    from optuna.trial import TrialState

    rng = random.Random(seed)
    cmd = [sys.executable, __file__, "--child", storage, "--trials", str(trials)]
    killed = 0
    for _ in range(kills):
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
            killed += 1
    final = subprocess.run(cmd, timeout=600)
    found = trials_of(storage)
    interrupted = [t for t in found if t.user_attrs.get("verdict") == "interrupted"]
    reruns = [sum(1 for u in found if u.number > t.number and u.params == t.params
                  and u.user_attrs.get("verdict") != "interrupted") for t in interrupted]
    deployed = [t for t in found if t.user_attrs.get("verdict") in ("measured", "violates_slo", "failed", "cut_short")
                and "remeasure_of" not in t.user_attrs]
    return {"kills": killed, "final_exit": final.returncode, "trials": len(found), "budget": trials,
            "deployed": len(deployed), "interrupted": len(interrupted),
            "still_running": sum(t.state == TrialState.RUNNING for t in found),
            "interrupted_never_rerun": sum(r == 0 for r in reruns),
            "deployed_beyond_budget": max(0, len(deployed) - trials)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.trials)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = kill_and_resume(f"sqlite:///{tmp}/study.db", args.kills, args.trials)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
