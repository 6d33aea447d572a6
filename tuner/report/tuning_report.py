"""The tuning report: every trial with its settings, measurements and verdict (pruned and
failed ones with their reason), the best feasible settings against the engine defaults,
and for a multi-objective study the Pareto front. As a dict (written as JSON) and as a
fixed-width text table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from kvpilot.tuner.search.decision import decide
from kvpilot.tuner.search.loop import MEASURED, VIOLATES, best_measured, trial_summary
from kvpilot.tuner.search.objective import SLO, constraint_names

VERDICTS = ("measured", "violates_slo", "pruned", "cut_short", "failed", "duplicate", "known_failure")


def _windows(t: optuna.trial.FrozenTrial) -> list[float]:
    return list(t.user_attrs.get("window_values") or [t.values[0]])


def _ranked(study: optuna.Study) -> list[dict[str, Any]]:
    """Trials feasible in their first measurement, with their re-measurements: runs are the
    objective of every window (the trial's and its re-measurements'), feasible_runs how
    many of them met the SLOs. A trial stays feasible only while more than half of its
    measurements met the SLOs (one of two is not enough: a lucky first window is the
    commonest way to pick a setting that breaks the SLOs). Feasible ones first, then by
    best median."""
    again: dict[int, list[tuple[list[float], bool]]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if "remeasure_of" in t.user_attrs and t.user_attrs.get("verdict") in (MEASURED, VIOLATES):
            again.setdefault(t.user_attrs["remeasure_of"], []).append((_windows(t), t.user_attrs["verdict"] == MEASURED))
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    ranked = []
    for t in best_measured(study):
        runs, met = _windows(t), 1
        for windows, ok in again.get(t.number, []):
            runs += windows
            met += int(ok)
        measurements = 1 + len(again.get(t.number, []))
        ranked.append({"number": t.number, "settings": t.user_attrs["settings"], "runs": runs,
                       "median": statistics.median(runs), "spread": max(runs) - min(runs),
                       "feasible_runs": f"{met}/{measurements}", "feasible": met * 2 > measurements,
                       "measurements": measurements})
    return sorted(ranked, key=lambda r: (r["feasible"], r["median"] if maximize else -r["median"]), reverse=True)


def winner(ranked: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best feasible trial that was measured again, when any was: a trial seen in one
    measurement whose median beats a re-measured one's is more likely a lucky window than a
    better setting (the winner's curse; re-measuring the top is what exposed it), so it does
    not win on that window. Without re-measurements (--remeasure-top 0) the top of the
    ranking wins. None when no trial is feasible."""
    feasible = [r for r in ranked if r["feasible"]]
    again = [r for r in feasible if r["measurements"] > 1]
    return (again or feasible or [None])[0]


def pareto_front(study: optuna.Study) -> list[dict[str, Any]]:
    """Feasible measured trials no other feasible trial dominates (multi-objective)."""
    signs = [1 if d == optuna.study.StudyDirection.MAXIMIZE else -1 for d in study.directions]
    found = best_measured(study)

    def dominates(a, b) -> bool:
        sa = [s * v for s, v in zip(signs, a.values)]
        sb = [s * v for s, v in zip(signs, b.values)]
        return all(x >= y for x, y in zip(sa, sb)) and any(x > y for x, y in zip(sa, sb))

    front = [t for t in found if not any(dominates(o, t) for o in found if o is not t)]
    return [{"number": t.number, "values": list(t.values), "settings": t.user_attrs["settings"]}
            for t in sorted(front, key=lambda t: t.values[0])]


def build(study: optuna.Study, slo: SLO, objective: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report as a JSON-able dict."""
    trials = [trial_summary(t) for t in study.get_trials(deepcopy=False)]
    names = constraint_names(slo)
    for t in trials:
        measured = t["verdict"] in ("measured", "violates_slo", "duplicate")
        t["violations"] = [n for n, v in zip(names, t["constraints"] or ()) if v > 0] if measured else []
    defaults = next((t for t in trials if t["is_defaults"] and t["remeasure_of"] is None and t["values"]), None)
    report: dict[str, Any] = {
        "study": study.study_name, "objective": objective, "slo": vars(slo), "meta": meta or {},
        "trials": trials,
        "counts": {k: sum(1 for t in trials if t["verdict"] == k) for k in VERDICTS},
        "defaults": defaults and {"number": defaults["number"], "settings": defaults["settings"],
                                  "objective": defaults["values"][0], "feasible": defaults["verdict"] == MEASURED,
                                  "violations": defaults["violations"]},
    }
    if objective == "multi":
        report["pareto_front"] = pareto_front(study)
        report["best"] = None
        return report
    ranked = _ranked(study)
    report["ranking"] = ranked
    best = winner(ranked)
    report["best"] = best
    incumbent = defaults and (next((r for r in ranked if r["number"] == defaults["number"]), None)
                              or {"number": defaults["number"], "runs": [defaults["values"][0]], "feasible": False})
    report["decision"] = decide(best, incumbent, study.directions[0] == optuna.study.StudyDirection.MAXIMIZE).as_dict()
    if best and defaults:
        base = incumbent["median"] if incumbent["feasible"] else 0.0
        report["improvement"] = {"best_over_defaults": (best["median"] / base) if base > 0 else None,
                                 "best_minus_defaults": best["median"] - base}
    return report


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(report: dict[str, Any]) -> str:
    """A text table, one row per trial, then the best against the defaults."""
    head = f"{'#':>3} {'settings':<44} {'goodput':>8} {'req/s':>7} {'ttft95':>8} {'itl95':>7} {'preempt/m':>9}  verdict"
    lines = [head, "-" * len(head)]
    for t in report["trials"]:
        m, s = t["measurement"] or {}, t["settings"] or {}
        desc = (f"mnbt={s.get('max_num_batched_tokens')} seqs={s.get('max_num_seqs')} "
                f"gmu={s.get('gpu_memory_utilization')} {'chunk' if s.get('enable_chunked_prefill') else 'nochunk'}")
        tag = " (defaults)" if t["is_defaults"] else (f" (again #{t['remeasure_of']})" if t["remeasure_of"] is not None
                                                     else "")
        ms = (lambda k: m[k] * 1000 if m.get(k) is not None else None)
        verdict = (t["verdict"] or t["state"].lower()) + tag
        if t["violations"]:
            verdict += " [" + ", ".join(t["violations"]) + "]"
        if t["reason"]:
            verdict += ": " + t["reason"].splitlines()[0][:90]
        lines.append(f"{t['number']:>3} {desc:<44} {_fmt(m.get('goodput_rps')):>8} {_fmt(m.get('throughput_rps')):>7} "
                     f"{_fmt(ms('ttft_p95_s'), 0):>8} {_fmt(ms('itl_p95_s'), 0):>7} "
                     f"{_fmt(m.get('preemptions_per_min'), 1):>9}  {verdict}")
    lines.append("")
    best, defaults = report.get("best"), report.get("defaults")
    if report.get("pareto_front") is not None:
        lines.append("Pareto front (throughput req/s, p95 latency ms):")
        lines += [f"  #{p['number']}: {p['values'][0]:.3f}, {p['values'][1]:.0f}" for p in report["pareto_front"]]
    elif best:
        lines.append(f"best: trial #{best['number']} {report['objective']} median {best['median']:.3f} "
                     f"over {len(best['runs'])} run(s), spread {best['spread']:.3f}: {best['settings']}")
        if defaults and defaults["feasible"]:
            ratio = (report.get("improvement") or {}).get("best_over_defaults")
            lines.append(f"defaults: trial #{defaults['number']} {report['objective']} {defaults['objective']:.3f}; "
                         f"best/defaults = {_fmt(ratio)}")
        elif defaults:
            lines.append(f"defaults: trial #{defaults['number']} {report['objective']} {defaults['objective']:.3f} "
                         f"but they break the SLOs ({', '.join(defaults['violations'])}); the best meets them")
    else:
        lines.append("no trial met the SLOs")
    if report.get("decision"):
        d = report["decision"]
        lines.append(f"decision: {'deploy trial #' + str(d['winner']) if d['replace'] else 'keep the running settings'}"
                     f" ({d['reason']})")
    return "\n".join(lines)


def write(report: dict[str, Any], folder: Path) -> Path:
    """Writes report.json and report.txt into folder; returns the JSON path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.txt").write_text(table(report) + "\n")
    path = folder / "report.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
