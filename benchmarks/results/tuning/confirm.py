"""Tuning-quality benchmark, step 3 (live): the tuner's choice against the engine defaults
on the real engine, per scenario, a few windows each, interleaved (defaults, choice,
defaults, choice, ...) on one engine (the two differ only in scheduler limits, changed
live), judged against the scenario's SLOs from `replay.json`. The choice is the setting
the tuner chose most often over the replay's seeds among the seeds where it replaced the
defaults (keeping them needs no confirmation).

    .venv/bin/python benchmarks/results/tuning/confirm.py [--windows 3] [--scenarios preempt,ttft,itl]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile
import time

from grid import MODEL, SCENARIOS, offsets, requests_for, window
from replay import window_measurement

from kvpilot.engine.settings import flag_words
from kvpilot.loadgen.tokenizers import load_tokenizer
from kvpilot.tuner.engine_process import EngineProcess
from kvpilot.tuner.local import WindowMeasurer
from kvpilot.tuner.objective import SLO, is_feasible, slack
from kvpilot.tuner.settings import EngineSettings
from kvpilot.tuner.workload import Workload

HERE = pathlib.Path(__file__).parent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--replay", default=str(HERE / "replay.json"))
    p.add_argument("--out", default=str(HERE / "confirm.json"))
    a = p.parse_args()
    replayed = json.loads(pathlib.Path(a.replay).read_text())
    out_path = pathlib.Path(a.out)
    out = json.loads(out_path.read_text()) if out_path.exists() else {}
    tokenizer = load_tokenizer(MODEL)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tuning-confirm-"))
    for name in a.scenarios.split(","):
        spec, r = SCENARIOS[name], replayed[name]
        slo = SLO(**r["slo"])
        defaults = EngineSettings(max_model_len=spec["max_model_len"])
        choices = collections.Counter(json.dumps(c, sort_keys=True) for c in r["strategies"]["tuner"]["choices"]
                                      if c != defaults.as_dict())
        if not choices:  # the tuner kept the defaults in every seed: nothing to confirm
            out[name] = {"slo": r["slo"], "defaults": defaults.as_dict(), "chosen": None,
                         "note": "the tuner kept the defaults in every seed"}
            out_path.write_text(json.dumps(out, indent=1) + "\n")
            print(f"{name}: the tuner kept the defaults in every seed", file=sys.stderr, flush=True)
            continue
        chosen = EngineSettings(**json.loads(choices.most_common(1)[0][0]))
        requests, offs = requests_for(name, tokenizer), offsets(name)
        workload = Workload(num_requests=spec["requests"], warmup_requests=1, ignore_eos=True)
        engine = EngineProcess(MODEL, workdir / f"{name}.log",
                               [*flag_words("num_gpu_blocks_override", spec["kv_blocks"]), "--disable-log-requests"])
        measurer = WindowMeasurer(workload, None, SLO(), MODEL)
        runs: dict[str, list[dict]] = {"defaults": [], "chosen": []}
        try:
            engine.start(defaults)
            for i in range(a.windows):
                for label, s in (("defaults", defaults), ("chosen", chosen)):
                    if engine.settings != s:
                        engine.apply_live(engine.settings.live_changes(s))
                    w = window(engine, measurer, requests, offs, workload)
                    m = window_measurement(w, slo)
                    runs[label].append({"goodput_rps": m.goodput_rps, "ttft_p95_ms": m.ttft_p95_s * 1000,
                                        "itl_p95_ms": m.itl_p95_s * 1000, "preemptions": m.preemptions,
                                        "failed": m.failed, "meets_slo": is_feasible(slack(m, slo)),
                                        "load_avg": open("/proc/loadavg").read().split()[:3],
                                        "finished": time.strftime("%H:%M:%S", time.gmtime())})
                    print(f"{name} {label} window {i}: {runs[label][-1]}", file=sys.stderr, flush=True)
        finally:
            engine.stop()
        summary = {k: {"median_goodput_rps": statistics.median(x["goodput_rps"] for x in v),
                       "windows_meeting_slo": f"{sum(x['meets_slo'] for x in v)}/{len(v)}"} for k, v in runs.items()}
        base = summary["defaults"]["median_goodput_rps"]
        out[name] = {"slo": r["slo"], "defaults": defaults.as_dict(), "chosen": chosen.as_dict(),
                     "chosen_by_seeds": f"{choices.most_common(1)[0][1]} of the {sum(choices.values())} seeds "
                                        f"that replaced the defaults (of {len(r['strategies']['tuner']['choices'])})",
                     "windows": runs, "summary": summary,
                     "chosen_over_defaults": summary["chosen"]["median_goodput_rps"] / base if base > 0 else None,
                     "cpu": next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                 if ln.startswith("model name"))}
        out_path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"{name}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
