"""The workload's shape over a window (tuner/measure/shape.py) and the one-reading window of both
measurement sources (observe_window): rate and length quantiles from vLLM's request length
histograms, the ratio shift test and the distance between workloads."""
from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.measure.scrape import ScrapeSource, parse_metrics
from kvpilot.tuner.measure.shape import (FIGURES, OUTPUT_TOKENS, PROMPT_TOKENS, WorkloadShape, distance, shape_between,
                                 shifted)
from kvpilot.tuner.measure.window import Snapshot, histogram_quantile, window_metrics

INF = math.inf
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)  # vLLM's build_1_2_5_buckets(2048)


def traffic_metrics(prompts, outputs, aborted=0, model="m"):
    """A /metrics page in vLLM v1's names: one finished request per (prompt, output) length,
    `aborted` more requests finished with reason abort (lengths not observed)."""
    reg = CollectorRegistry()
    labels = {"model_name": model}
    prompt = Histogram(PROMPT_TOKENS, "", ["model_name"], registry=reg, buckets=TOKEN_BUCKETS)
    output = Histogram(OUTPUT_TOKENS, "", ["model_name"], registry=reg, buckets=TOKEN_BUCKETS)
    for p, o in zip(prompts, outputs):
        prompt.labels(**labels).observe(p)
        output.labels(**labels).observe(o)
    done = Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=reg)
    done.labels(model_name=model, finished_reason="length").inc(len(prompts))
    done.labels(model_name=model, finished_reason="abort").inc(aborted)
    Counter("vllm:num_preemptions", "", ["model_name"], registry=reg).labels(**labels).inc(0)
    Counter("vllm:generation_tokens", "", ["model_name"], registry=reg).labels(**labels).inc(sum(outputs))
    Gauge("vllm:num_requests_running", "", ["model_name"], registry=reg).labels(**labels).set(0)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], registry=reg, buckets=(0.1, 1.0))
    for _ in prompts:
        ttft.labels(**labels).observe(0.05)
    return generate_latest(reg).decode()


def shape(rps=1.0, p50=200.0, p90=600.0, o50=100.0, o90=128.0, requests=60.0) -> WorkloadShape:
    return WorkloadShape(60.0, requests, rps, p50, p90, o50, o90)


def test_parse_metrics_keeps_the_request_length_buckets():
    snap = parse_metrics(traffic_metrics([150, 300, 3000], [8, 120, 120]), {"model_name": "m"}, time_s=0)
    assert snap.buckets[PROMPT_TOKENS][200] == 1 and snap.buckets[PROMPT_TOKENS][500] == 2
    assert snap.buckets[PROMPT_TOKENS][INF] == 3 and snap.buckets[OUTPUT_TOKENS][10] == 1
    # the measurement ignores them: the same window as without the length histograms
    m = window_metrics(Snapshot(time_s=-10), snap, SLO(), "scrape")
    assert m.completed == 3 and m.ttft_p95_s == pytest.approx(0.1 * 2.85 / 3)


def test_shape_between_two_snapshots_is_the_windows_rate_and_quantiles():
    before = ([100] * 10, [50] * 10)
    window = ([300] * 30 + [800] * 10, [120] * 40)
    start = parse_metrics(traffic_metrics(*before, aborted=2), time_s=100)
    end = parse_metrics(traffic_metrics(before[0] + window[0], before[1] + window[1], aborted=9), time_s=160)
    s = shape_between(start, end)
    assert s.duration_s == 60 and s.requests == 40  # 7 aborts in the window are not requests served
    assert s.arrival_rps == pytest.approx(40 / 60)
    prompt_window = {200: 0, 500: 30, 1000: 40, 2000: 40, INF: 40}
    assert s.prompt_tokens_p50 == pytest.approx(histogram_quantile(0.5, prompt_window))
    assert s.prompt_tokens_p50 == pytest.approx(200 + 300 * 20 / 30)  # inside bucket 200-500
    assert s.prompt_tokens_p90 == pytest.approx(500 + 500 * (36 - 30) / 10)
    assert s.output_tokens_p50 == pytest.approx(100 + 100 * 20 / 40)
    assert "0.67 req/s, prompt p50/p90 400/800 tokens, output p50/p90 150/190 tokens" == s.describe()


def test_an_idle_window_has_no_quantiles_and_no_rate():
    snap = parse_metrics(traffic_metrics([100], [10]), time_s=0)
    s = shape_between(snap, Snapshot(time_s=30, counters=snap.counters, buckets=snap.buckets))
    assert s.requests == 0 and s.arrival_rps == 0
    assert all(math.isnan(getattr(s, f)) for f in FIGURES[1:])
    assert "?/? tokens" in s.describe()


def test_as_dict_is_json_able_and_from_dict_reads_it_back_tolerating_missing_keys():
    s = WorkloadShape(60.0, 0.0, 0.0)
    d = s.as_dict()
    assert d["prompt_tokens_p50"] is None and d["requests"] == 0.0
    back = WorkloadShape.from_dict(d)
    assert back.duration_s == 60 and math.isnan(back.prompt_tokens_p50)
    partial = WorkloadShape.from_dict({"arrival_rps": 2, "unknown": 1})
    assert partial.arrival_rps == 2.0 and math.isnan(partial.duration_s)
    assert WorkloadShape.from_dict(shape().as_dict()) == shape()


def test_shifted_flags_figures_past_the_ratio_either_way():
    ref = shape()
    assert shifted(ref, ref) == {}
    assert shifted(ref, shape(p50=880)) == {"prompt_tokens_p50": (200, 880)}
    assert shifted(ref, shape(rps=0.4)) == {"arrival_rps": (1.0, 0.4)}  # 2.5 times lower
    assert shifted(ref, shape(rps=2.0, p90=300)) == {}  # exactly the ratio is not past it
    assert shifted(ref, shape(o90=300), ratio=2.5) == {}
    assert set(shifted(ref, shape(rps=5, o50=20))) == {"arrival_rps", "output_tokens_p50"}
    with pytest.raises(ValueError, match="ratio must be > 1"):
        shifted(ref, ref, ratio=1.0)


def test_shifted_skips_figures_that_are_nan_or_zero_on_either_side():
    nan = math.nan
    assert shifted(shape(p50=nan, rps=0.0), shape(p50=900, rps=5)) == {}
    assert shifted(shape(p50=200), shape(p50=nan, o50=0.0)) == {}
    assert shifted(shape(p50=200, p90=nan), shape(p50=900, p90=100)) == {"prompt_tokens_p50": (200, 900)}


def test_distance_is_symmetric_log_ratio_and_inf_without_anything_to_compare():
    assert distance(shape(), shape()) == 0
    d = distance(shape(), shape(rps=2.0, p50=100))
    assert d == pytest.approx(2 * math.log(2)) and d == pytest.approx(distance(shape(rps=2.0, p50=100), shape()))
    assert distance(shape(), shape(p90=math.nan)) == 0  # the NaN figure is skipped
    empty = WorkloadShape(60, 0, 0.0)
    assert distance(empty, shape()) == INF
    # the nearest earlier workload
    earlier = [shape(p50=100), shape(p50=800), shape(rps=4)]
    assert min(earlier, key=lambda e: distance(e, shape(p50=700))) == shape(p50=800)


class MetricsPage:
    """A /metrics endpoint on loopback serving whatever text the test sets."""

    def __init__(self, text: str):
        self.text = text
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (http.server's name)
                body = page.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def page():
    p = MetricsPage(traffic_metrics([100] * 5, [20] * 5))
    yield p
    p.close()


def test_scrape_source_observes_measurement_and_shape_from_one_reading(page):
    source = ScrapeSource(page.url, {"model_name": "m"})
    start = source.begin()
    page.text = traffic_metrics([100] * 5 + [400] * 20, [20] * 5 + [120] * 20, aborted=3)
    m, s = source.observe_window(start, SLO())
    assert m.completed == 20 and m.failed == 3 and s.requests == 20
    assert s.duration_s == pytest.approx(m.duration_s)  # the same end reading
    assert s.prompt_tokens_p50 == pytest.approx(200 + 300 * 10 / 20)
    assert source.measure(start, SLO()).completed == 20


@pytest.mark.slow
def test_prometheus_source_reads_the_same_shape_as_the_scrape_source(page, tmp_path):
    from prometheus_harness import Prometheus

    from kvpilot.tuner.measure.promql import PrometheusSource

    prom = Prometheus(tmp_path, f"127.0.0.1:{page.port}")
    try:
        prom.wait_for('vllm:num_requests_running{job="engine"}')
        promql = PrometheusSource(prom.url, 'job="engine",model_name="m"', scrape_timeout_s=20)
        scrape = ScrapeSource(page.url, {"model_name": "m"})
        start_p, start_s = promql.begin(), scrape.begin()
        page.text = traffic_metrics([100] * 5 + [300] * 30 + [1500] * 7, [20] * 5 + [60] * 30 + [200] * 7, aborted=2)
        (mp, sp), (ms, ss) = promql.observe_window(start_p, SLO()), scrape.observe_window(start_s, SLO())
    finally:
        prom.stop()
    assert sp.requests == ss.requests == mp.completed == ms.completed == 37 and mp.failed == 2
    for figure in FIGURES[1:]:
        assert getattr(sp, figure) == pytest.approx(getattr(ss, figure)), figure
    assert sp.arrival_rps == pytest.approx(37 / sp.duration_s) and sp.duration_s == pytest.approx(mp.duration_s)
