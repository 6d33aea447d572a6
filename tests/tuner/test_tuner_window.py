"""Window arithmetic shared by the measurement sources: Prometheus's histogram_quantile,
/metrics parsing, counter and bucket deltas, config confirmation, failure classification."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot.tuner.failures import OUT_OF_MEMORY, REJECTED, TRANSIENT, TrialFailed, classify
from kvpilot.tuner.search.objective import SLO, Measurement, slack
from kvpilot.tuner.measure.scrape import parse_metrics
from kvpilot.tuner.measure.window import config_mismatches, fraction_at_most, histogram_quantile, window_metrics

INF = math.inf


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = {0.1: 10, 0.5: 60, 1.0: 90, INF: 100}
    # rank 95 falls in (1.0, +Inf]: Prometheus answers the highest finite bound
    assert histogram_quantile(0.95, buckets) == 1.0
    # rank 50 in (0.1, 0.5]: 0.1 + 0.4 * (50 - 10) / 50
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.42)
    # rank 5 in the first bucket, which starts at 0
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert math.isnan(histogram_quantile(0.5, {0.1: 0, INF: 0}))
    assert math.isnan(histogram_quantile(0.5, {0.1: 3, 1.0: 5}))  # no +Inf bucket
    assert histogram_quantile(1.5, buckets) == INF and histogram_quantile(-1, buckets) == -INF


def test_fraction_at_most_inverts_the_quantile():
    buckets = {0.1: 10, 0.5: 60, 1.0: 90, INF: 100}
    assert fraction_at_most(0.42, buckets) == pytest.approx(0.5)
    assert fraction_at_most(0.1, buckets) == pytest.approx(0.1)
    assert fraction_at_most(5.0, buckets) == pytest.approx(0.9)  # past the last finite bound
    assert math.isnan(fraction_at_most(1.0, {INF: 0}))


def engine_metrics(ttfts, itls, preemptions, requests, running=0, model="m"):
    """A /metrics page in vLLM's names, written by prometheus_client as the server does."""
    reg = CollectorRegistry()
    labels = {"model_name": model}
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["model_name"], registry=reg,
                     buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
    itl = Histogram("vllm:inter_token_latency_seconds", "", ["model_name"], registry=reg,
                    buckets=(0.01, 0.025, 0.05, 0.1, 0.25))
    for v in ttfts:
        ttft.labels(**labels).observe(v)
    for v in itls:
        itl.labels(**labels).observe(v)
    Counter("vllm:num_preemptions", "", ["model_name"], registry=reg).labels(**labels).inc(preemptions)
    Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=reg) \
        .labels(model_name=model, finished_reason="stop").inc(requests)
    Gauge("vllm:num_requests_running", "", ["model_name"], registry=reg).labels(**labels).set(running)
    info = Gauge("vllm:cache_config_info", "", ["block_size", "engine"], registry=reg)  # vLLM's: no model_name
    info.labels(block_size="16", engine="0").set(1)
    ours = Gauge("kvpilot:engine_config_info", "", ["model_name", "max_num_seqs", "enable_chunked_prefill"],
                 registry=reg)
    ours.labels(model_name=model, max_num_seqs="8", enable_chunked_prefill="True").set(1)
    return generate_latest(reg).decode()


def test_parse_metrics_reads_vllm_names_and_filters_by_label():
    text = engine_metrics([0.2, 0.3], [0.02] * 5, preemptions=3, requests=2, running=1)
    snap = parse_metrics(text, {"model_name": "m"}, time_s=10)
    assert snap.counters["vllm:num_preemptions_total"] == 3
    assert snap.counters["vllm:request_success_total"] == 2
    assert snap.buckets["vllm:time_to_first_token_seconds"][0.25] == 1
    assert snap.buckets["vllm:time_to_first_token_seconds"][INF] == 2
    assert snap.in_flight == 1
    assert snap.config_info == {"block_size": "16", "engine": "0", "model_name": "m", "max_num_seqs": "8",
                                "enable_chunked_prefill": "True"}  # both info gauges, merged
    other = parse_metrics(text, {"model_name": "other"}, time_s=10)
    assert other.counters == {} and other.buckets == {}


def failure_metrics(ok, aborted, http_5xx, http_4xx_other_route=0):
    """A /metrics page with vLLM's finished_reason counter and prometheus-fastapi-
    instrumentator's http_requests_total (labels handler, method, status as "2xx"/"5xx")."""
    reg = CollectorRegistry()
    done = Counter("vllm:request_success", "", ["model_name", "finished_reason"], registry=reg)
    done.labels(model_name="m", finished_reason="length").inc(ok)
    done.labels(model_name="m", finished_reason="abort").inc(aborted)
    http = Counter("http_requests", "", ["handler", "method", "status"], registry=reg)
    http.labels(handler="/v1/completions", method="POST", status="2xx").inc(ok + aborted)
    http.labels(handler="/v1/completions", method="POST", status="5xx").inc(http_5xx)
    http.labels(handler="/metrics", method="GET", status="4xx").inc(http_4xx_other_route)
    return generate_latest(reg).decode()


def test_aborted_requests_and_503s_count_as_failures_not_as_goodput():
    slo = SLO(ttft_p95_ms=0, itl_p95_ms=0)
    start = parse_metrics(failure_metrics(10, 1, 0), {"model_name": "m"}, time_s=0)
    end = parse_metrics(failure_metrics(16, 3, 4, http_4xx_other_route=7), {"model_name": "m"}, time_s=10)
    m = window_metrics(start, end, slo, "scrape")
    assert m.completed == 6 and m.failed == 2 + 4  # aborts + 5xx of /v1 routes; /metrics 4xx ignored
    assert m.goodput_rps == pytest.approx(0.6)
    assert slack(m, slo)[-1] == 6  # every failed request violates the failed_requests constraint
    # a server without HTTP metrics: aborts alone
    plain = window_metrics(parse_metrics(engine_metrics([], [], 0, 5), time_s=0),
                           parse_metrics(engine_metrics([], [], 0, 5), time_s=1), slo, "scrape")
    assert plain.failed == 0


def test_window_is_the_difference_of_two_snapshots():
    start = parse_metrics(engine_metrics([0.2] * 10, [0.02] * 10, 1, 10), time_s=100)
    end = parse_metrics(engine_metrics([0.2] * 10 + [0.4] * 20, [0.02] * 10 + [0.2] * 30, 4, 30), time_s=160)
    m = window_metrics(start, end, SLO(ttft_p95_ms=300, itl_p95_ms=100), "scrape")
    assert m.duration_s == 60 and m.completed == 20 and m.preemptions == 3
    assert m.preemptions_per_min == pytest.approx(3.0)
    # the window's 20 TTFTs are all 0.4 s (bucket 0.25-0.5): p95 interpolates to 0.25 + 0.25 * 0.95
    assert m.ttft_p95_s == pytest.approx(0.4875)
    assert m.itl_p95_s == pytest.approx(0.1 + 0.15 * 0.95)
    # no TTFT in the window is <= 300 ms by the histogram: 0.25 + 0.05/0.25 of the bucket -> 20 %
    assert m.goodput_rps == pytest.approx(20 * 0.2 / 60)


def test_counter_reset_counts_from_zero_like_increase():
    start = parse_metrics(engine_metrics([], [], 50, 100), time_s=0)
    end = parse_metrics(engine_metrics([0.1], [], 2, 1), time_s=10)  # the engine restarted
    m = window_metrics(start, end, SLO(), "scrape")
    assert m.preemptions == 2 and m.completed == 1


def test_config_mismatches_normalise_booleans_and_numbers():
    info = {"max_num_seqs": "8", "enable_chunked_prefill": "True", "gpu_memory_utilization": "0.90"}
    assert config_mismatches(info, {"max_num_seqs": 8, "enable_chunked_prefill": True,
                                    "gpu_memory_utilization": 0.9, "block_size": 32}) == {}
    assert config_mismatches(info, {"max_num_seqs": 16}) == {"max_num_seqs": ("16", "8")}


def test_a_setting_the_trial_leaves_unset_matches_what_the_engine_chose():
    """vLLM on CPU reports kv_cache_memory_bytes from VLLM_CPU_KVCACHE_SPACE (the operator's
    launcher sets it) when the trial gives none: that is not another configuration."""
    info = {"kv_cache_memory_bytes": "1073741824", "block_size": "128"}
    assert config_mismatches(info, {"kv_cache_memory_bytes": None, "block_size": 128}) == {}
    assert config_mismatches(info, {"kv_cache_memory_bytes": 1 << 29}) == {
        "kv_cache_memory_bytes": (str(1 << 29), "1073741824")}


def test_max_model_len_auto_matches_whatever_length_the_engine_chose():
    info = {"max_model_len": "320", "max_num_seqs": "8"}
    assert config_mismatches(info, {"max_model_len": -1, "max_num_seqs": 8}) == {}
    assert config_mismatches(info, {"max_model_len": 256}) == {"max_model_len": ("256", "320")}


def test_slack_marks_each_violated_slo_and_empty_windows():
    slo = SLO(ttft_p95_ms=500, itl_p95_ms=100, max_preemptions_per_min=1)
    ok = Measurement(duration_s=60, completed=10, ttft_p95_s=0.4, itl_p95_s=0.05, preemptions=1)
    assert all(v <= 0 for v in slack(ok, slo))
    slow = Measurement(duration_s=60, completed=10, ttft_p95_s=0.6, itl_p95_s=0.05, preemptions=3, failed=1)
    assert slack(slow, slo) == pytest.approx([100, -50, 2, 1])
    empty = Measurement(duration_s=60, completed=0)
    assert all(v > 0 for v in slack(empty, slo)[:2])


@pytest.mark.parametrize("code, log, kind", [
    (1, "ValueError: To serve one request of max_model_len (8192 tokens), 512 KV blocks (0.1 GiB) are needed",
     OUT_OF_MEMORY),
    (-9, "", OUT_OF_MEMORY),
    (1, "torch.OutOfMemoryError: CUDA out of memory", OUT_OF_MEMORY),
    (2, "kvpilot serve: error: argument --block-size: invalid int value", REJECTED),
    (1, "ValueError: max_num_batched_tokens (64) must be >= max_num_seqs (128)", REJECTED),
    (1, "OSError: [Errno 98] Address already in use", TRANSIENT),
    (1, "Segmentation fault", TRANSIENT),
])
def test_failure_classification_from_exit_and_log(code, log, kind):
    assert classify(code, log) == kind
    assert TrialFailed(kind, log).retryable == (kind == TRANSIENT)
