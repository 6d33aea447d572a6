"""Every query of the Grafana dashboard (panels, variables, annotations) run against the real
Prometheus scraping the real engine and the tuner's real exporter (prometheus_stack.py), each
evaluated at the end of the workload with its values checked against what the client and the
counters saw: the preemption rate equals the counter's delta over the window, TTFT p95 is
within a bucket of the client's own p95, the SLO lines equal spec.slo, the tuning panels
equal what the tuner recorded; the watch-window panels (continuous tuning) show the shifted
window at the end and, at the start, a gap where the first window had no figure (NaN).

`$__rate_interval` is the workload's window: Grafana sets it to $__interval + the scrape
interval (at least 4 scrapes), and $__interval is the window when one point covers it (a
stat panel, or this instant query); a fixed 5m would average the window with idle time."""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

import pytest
from prometheus_stack import (RETUNE_REASON, ROLLOUT_STARTED_S, SETTINGS, SHIFTED_WINDOW, TARGET_LABELS, TEST_SLO,
                              TRIALS)

from kvpilot.engine.metrics.engine_metrics import TTFT_BUCKETS

pytestmark = pytest.mark.slow

DASHBOARD = json.loads((Path(__file__).resolve().parents[2] / "charts" / "kvpilot" / "dashboards"
                        / "kvpilot.json").read_text())


_, _, SHAPE = SHIFTED_WINDOW
# (panel, refId) -> (value at the workload's end, by quantile where it has one; at its start, None: a gap)
WATCH_PANELS = {
    ("SLO attainment (live)", "A"): (SHIFTED_WINDOW[0], None),
    ("SLO attainment (live)", "B"): (SHIFTED_WINDOW[1], 0),
    ("Workload shape", "A"): ({"0.5": SHAPE["prompt_tokens_p50"], "0.9": SHAPE["prompt_tokens_p90"]}, None),
    ("Workload shape", "B"): ({"0.5": SHAPE["output_tokens_p50"], "0.9": SHAPE["output_tokens_p90"]}, None),
    ("Workload shape", "C"): (SHAPE["arrival_rps"], 0),
    ("Re-tunes", "B"): (0, 1),  # watching until the re-tune's study
}


def window_s(workload: dict) -> int:
    return math.ceil(workload["end_s"] - workload["start_s"]) + 1


def substitute(expr: str, rate_interval_s: int) -> str:
    values = {"$__rate_interval": f"{rate_interval_s}s", "$namespace": TARGET_LABELS["namespace"],
              "$isvc": TARGET_LABELS["app_kubernetes_io_instance"]}
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def test_every_panel_query_returns_the_workloads_values(stack, workload):
    prometheus, w = stack.prometheus, window_s(workload)
    at = workload["end_s"]

    def results(panel: dict, target: dict) -> list[dict]:
        return prometheus.query(substitute(target["expr"], w), at)

    def one(panel: dict, target: dict) -> float:
        found = results(panel, target)
        assert len(found) == 1, (panel["title"], target["refId"], found)
        return float(found[0]["value"][1])

    def counter_delta(metric: str) -> float:
        sel = '{job="kvpilot"}'
        return prometheus.value(f"sum({metric}{sel})", at) - (prometheus.value(f"sum({metric}{sel})", at - w) or 0)

    def near(value: float, expected: float, rel: float = 0.15) -> bool:
        return abs(value - expected) <= rel * abs(expected) + 1e-9

    def latency(panel, target):  # a finite positive quantile
        v = one(panel, target)
        assert math.isfinite(v) and v > 0, (panel["title"], target["refId"], v)

    def ttft(panel, target):
        if target["legendFormat"] == "p95":  # within one bucket of the client's own p95
            client = p95(workload["client_ttft_s"])
            edges = [0.0, *TTFT_BUCKETS]
            assert abs(bisect.bisect_left(edges, one(panel, target)) - bisect.bisect_left(edges, client)) <= 1, \
                (one(panel, target), client)
        latency(panel, target)

    def queue(panel, target):  # zero when nothing waited: the lowest bucket's interpolation
        v = one(panel, target)
        assert math.isfinite(v) and v >= 0, v

    def watching(panel, target):  # the shifted window at the end; at the start, the first (NaN: a gap)
        if (panel["title"], target["refId"]) == ("Re-tunes", "A"):  # increase() extrapolates by up to w / (w - 2)
            got = {r["metric"]["reason"]: float(r["value"][1]) for r in results(panel, target)}
            assert got.keys() == {"SLOBreached", "WorkloadShifted"} and got["SLOBreached"] == 0, got
            assert 1 <= got[RETUNE_REASON] <= 1.2, got
            return
        at_end, at_start = WATCH_PANELS[panel["title"], target["refId"]]
        end = {r["metric"].get("quantile"): float(r["value"][1]) for r in results(panel, target)}
        start = {r["metric"].get("quantile"): float(r["value"][1])
                 for r in prometheus.query(substitute(target["expr"], w), workload["start_s"])}
        assert end == (at_end if isinstance(at_end, dict) else {None: at_end}), (panel["title"], target["refId"], end)
        assert start == ({} if at_start is None else {None: at_start}), (panel["title"], target["refId"], start)

    checks = {
        "Time to first token (p50/p95/p99)": ttft,
        "Inter-token latency (p50/p95/p99)": latency,
        "End-to-end request latency (p50/p95/p99)": latency,
        "Queue time (p50/p95)": queue,
        "SLO attainment (live)": watching,
        "Workload shape": watching,
        "Re-tunes": watching,
    }
    checked = set()
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", ()):  # a row has none
            title, ref, legend = panel["title"], target["refId"], target.get("legendFormat", "")
            checked.add((panel["id"], ref))
            if legend == "SLO":
                slo = {"Time to first token (p50/p95/p99)": TEST_SLO.ttft_p95_ms / 1000,
                       "Inter-token latency (p50/p95/p99)": TEST_SLO.itl_p95_ms / 1000,
                       "Preemptions per minute": TEST_SLO.max_preemptions_per_min}[title]
                assert one(panel, target) == slo, title
            elif title in checks:
                checks[title](panel, target)
            elif title == "Throughput":
                if ref == "C":  # requests/s by finished reason
                    total = sum(float(r["value"][1]) for r in results(panel, target))
                    assert near(total, workload["requests"] / w), (total, workload["requests"], w)
                else:
                    counter = {"A": "vllm:generation_tokens_total", "B": "vllm:prompt_tokens_total"}[ref]
                    expected = {"A": workload["generation"], "B": workload["prompt"]}[ref]
                    assert counter_delta(counter) == expected
                    assert near(one(panel, target), expected / w), (ref, one(panel, target), expected / w)
            elif title == "Preemptions per minute":
                delta = counter_delta("vllm:num_preemptions_total")
                assert delta > 0 and near(one(panel, target), delta / w * 60), (one(panel, target), delta, w)
            elif title == "Running and waiting requests":
                assert one(panel, target) == 0  # all finished at the window's end
            elif title == "KV-cache usage":
                assert 0 <= one(panel, target) <= 1
            elif title == "Prefix-cache hit rate":
                assert 0 <= one(panel, target) <= 1
            elif title == "Tokens per engine step (p50/p95)":
                assert 1 <= one(panel, target) <= 16384
            elif title == "Current engine settings":
                labels = results(panel, target)[0]["metric"]
                assert labels["max_num_seqs"] == str(SETTINGS["max_num_seqs"]) and labels["pod"] == "smollm2-0"
            elif title == "Tuning: last trial":
                assert one(panel, target) == len(TRIALS) - 1
            elif title == "Tuning: best goodput":
                assert one(panel, target) == TRIALS[-1][2]
            elif title == "Tuning: trials by verdict":
                got = {r["metric"]["verdict"]: float(r["value"][1]) for r in results(panel, target)}
                assert got == {verdict: 1.0 for verdict, _, _ in TRIALS}
            elif title == "Tuning: settings of the last trial":
                labels = results(panel, target)[0]["metric"]
                assert labels["max_num_seqs"] == str(TRIALS[-1][1]["max_num_seqs"])
                assert labels["enable_chunked_prefill"] == str(TRIALS[-1][1]["enable_chunked_prefill"])
            elif title == "Operator: leader":
                assert one(panel, target) == 1
            elif title == "Operator: reconcile duration p95 by handler":
                got = {r["metric"]["handler"]: float(r["value"][1]) for r in results(panel, target)}
                # the operator's metrics are the process's: earlier tests in the session leave other
                # handlers in them, with no reconcile in this window (rate 0/0: NaN)
                others = [v for handler, v in got.items() if handler != "update"]
                assert 0.025 <= got["update"] <= 0.05 and all(math.isnan(v) for v in others), got
            elif title == "InferenceService conditions":
                got = {r["metric"]["condition"]: float(r["value"][1]) for r in results(panel, target)}
                assert got == {"Ready": 1, "Progressing": 1, "Degraded": 0, "Failed": 0}, got
            elif title == "Rollout age":  # as of the last scrape before `at` (1 s scrapes)
                assert abs(one(panel, target) - (at - ROLLOUT_STARTED_S)) <= 3, (one(panel, target), at)
            elif title == "Tuning phase":
                found = results(panel, target)
                if ref == "A":
                    assert [r["metric"]["phase"] for r in found] == ["Running"]
                else:
                    assert one(panel, target) == 1
            else:
                pytest.fail(f"panel {title!r} ({ref}) has no value check")
    assert len(checked) == sum(len(p.get("targets", ())) for p in DASHBOARD["panels"])


def test_variables_and_annotations_find_the_engine_the_tuner_and_their_rollouts(stack, workload):
    prometheus, w = stack.prometheus, window_s(workload)
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            metric = substitute(variable["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0], w)
            assert prometheus.query(metric), variable["name"]
    annotations = {a["name"]: a["target"]["expr"] for a in DASHBOARD["annotations"]["list"] if "target" in a}
    rollouts = prometheus.query_range(substitute(annotations["Engine rollouts"], w), stack.started_s - 5,
                                      workload["end_s"])
    assert [r["metric"]["max_num_seqs"] for r in rollouts] == [str(SETTINGS["max_num_seqs"])]
    trials = prometheus.query_range(substitute(annotations["Tuning trials"], w), workload["start_s"],
                                    workload["end_s"])
    assert trials and all(float(v) > 0 for r in trials for _, v in r["values"])
