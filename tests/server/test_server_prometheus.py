"""/metrics scraped by a real Prometheus (Debian's 2.42, on loopback): the colon names are
stored unchanged, PromQL returns the token and request counts of a known workload,
histograms have samples, vllm:num_preemptions rises when the KV cache is made too small.
The stack and workload: prometheus_stack.py; the dashboard's panels: test_server_dashboard.py."""

from __future__ import annotations

import httpx
import pytest
from prometheus_stack import SETTINGS
from vllm_metric_table import check_against_table, families

pytestmark = pytest.mark.slow


def test_prometheus_stores_the_colon_names_unchanged(stack, workload):
    prometheus = stack.prometheus
    names = httpx.get(f"{prometheus.url}/api/v1/label/__name__/values").json()["data"]
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert name in names
    assert not [n for n in names if n.startswith("vllm_")]  # no OpenMetrics underscore copies


def test_without_the_flag_the_server_exports_vllms_set_and_no_hidden_metric(stack, workload):
    server = stack.server
    check_against_table(families(httpx.get(f"{server.url}/metrics").text), SETTINGS["max_model_len"], None)


def test_promql_returns_the_workloads_token_and_request_counts(stack, workload):
    server, prometheus = stack.server, stack.prometheus
    q = prometheus.value
    assert q('sum(vllm:prompt_tokens_total{job="kvpilot"})') == workload["prompt"]
    assert q('sum(vllm:generation_tokens_total{job="kvpilot"})') == workload["generation"]
    assert q('sum(vllm:request_success_total{finished_reason=~"stop|length"})') == workload["requests"]
    assert q('sum(vllm:request_prompt_tokens_sum)') == workload["prompt"]
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert q(f"sum(vllm:{histogram}_count)") == workload["requests"], histogram
    assert q("sum(vllm:inter_token_latency_seconds_count)") == workload["generation"] - workload["requests"]
    p50 = q("histogram_quantile(0.5, sum by (le) (vllm:time_to_first_token_seconds_bucket))")
    assert 0 < p50 < 60
    labels = prometheus.query("vllm:num_requests_running")[0]["metric"]
    assert labels["model_name"] == "smollm2-135m-instruct" and labels["engine"] == "0"


def test_num_preemptions_rises_when_the_kv_cache_is_too_small(stack, workload):
    server, prometheus = stack.server, stack.prometheus
    preemptions = prometheus.value('vllm:num_preemptions_total{job="kvpilot"}')
    assert preemptions > 0  # it was 0 before the workload
    assert preemptions == server.metric("vllm:num_preemptions_total")
    assert "preempted by PreemptionMode.RECOMPUTE" in server.log()


def test_stats_lines_report_throughput_and_queues_like_vllm(stack, workload):
    server = stack.server
    line = next(line for line in server.log().splitlines() if "Avg generation throughput" in line)
    assert "Engine 000: Avg prompt throughput:" in line and "Running:" in line and "GPU KV cache usage:" in line
