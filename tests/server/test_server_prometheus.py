"""/metrics scraped by a real Prometheus (Debian's 2.42, on loopback): the colon names are
stored unchanged, PromQL returns the token and request counts of a known workload,
histograms have samples, vllm:num_preemptions rises when the KV cache is made too small,
and every engine panel of the Grafana dashboard returns data."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from server_harness import ServerProcess, engine_flags, free_port, wait_until
from vllm_metric_table import check_against_table, families

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"
# The labels a PodMonitor would add in the cluster; the dashboard filters on them.
TARGET_LABELS = {"namespace": "default", "app_kubernetes_io_instance": "smollm2", "pod": "smollm2-0"}
# 16 blocks of 16 tokens: four 60-token prompts fill them, the first decode past 64 tokens preempts.
SETTINGS = {"max_model_len": 256, "max_num_seqs": 4, "num_gpu_blocks_override": 16, "block_size": 16,
            "dtype": "float32"}


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is installed by scripts/install-tools.sh (Debian's prometheus package)"
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "kvpilot", "static_configs": [
                      {"targets": [target], "labels": TARGET_LABELS}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("prometheus")
    server = ServerProcess(workdir / "server.log", *engine_flags(**SETTINGS))
    prometheus = Prometheus(workdir, f"127.0.0.1:{server.port}")
    try:
        server.start()
        wait_until(lambda: prometheus.value('vllm:num_preemptions_total{job="kvpilot"}') is not None, 60, 0.5,
                   "the first scrape")
        yield server, prometheus
    finally:
        server.stop()
        prometheus.stop()


@pytest.fixture(scope="module")
def workload(stack) -> dict:
    """Four concurrent completions that must preempt, a chat and a stream; returns the
    totals the client saw, once Prometheus has scraped them all."""
    server, prometheus = stack
    assert prometheus.value('vllm:num_preemptions_total{job="kvpilot"}') == 0
    client = httpx.Client(base_url=server.url, timeout=180)
    prompt = " ".join(["word"] * 59)

    def complete(i: int) -> dict:
        return client.post("/v1/completions", json={"prompt": f"{i} {prompt}", "max_tokens": 16,
                                                    "ignore_eos": True}).json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(complete, range(4)))
    answers.append(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}).json())
    stream = client.post("/v1/completions", json={"prompt": "One two", "max_tokens": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    answers.append(json.loads(stream.text.split("data: ")[-2]))
    totals = {"requests": len(answers), "prompt": sum(a["usage"]["prompt_tokens"] for a in answers),
              "generation": sum(a["usage"]["completion_tokens"] for a in answers)}
    wait_until(lambda: prometheus.value('sum(vllm:request_success_total{job="kvpilot"})') == totals["requests"],
               60, 0.5, "Prometheus to scrape the finished requests")
    return totals


def test_prometheus_stores_the_colon_names_unchanged(stack, workload):
    _, prometheus = stack
    names = httpx.get(f"{prometheus.url}/api/v1/label/__name__/values").json()["data"]
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert name in names
    assert not [n for n in names if n.startswith("vllm_")]  # no OpenMetrics underscore copies


def test_without_the_flag_the_server_exports_vllms_set_and_no_hidden_metric(stack, workload):
    server, _ = stack
    check_against_table(families(httpx.get(f"{server.url}/metrics").text), SETTINGS["max_model_len"], None)


def test_promql_returns_the_workloads_token_and_request_counts(stack, workload):
    server, prometheus = stack
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
    server, prometheus = stack
    preemptions = prometheus.value('vllm:num_preemptions_total{job="kvpilot"}')
    assert preemptions > 0  # it was 0 before the workload
    assert preemptions == server.metric("vllm:num_preemptions_total")
    assert "preempted by PreemptionMode.RECOMPUTE" in server.log()


def test_stats_lines_report_throughput_and_queues_like_vllm(stack, workload):
    server, _ = stack
    line = next(line for line in server.log().splitlines() if "Avg generation throughput" in line)
    assert "Engine 000: Avg prompt throughput:" in line and "Running:" in line and "GPU KV cache usage:" in line


def substitute(expr: str) -> str:
    """Grafana's variables replaced by values that select the test target."""
    values = {"$__rate_interval": "5m", "$namespace": TARGET_LABELS["namespace"],
              "$isvc": TARGET_LABELS["app_kubernetes_io_instance"], "$ttft_slo_ms": "2000", "$itl_slo_ms": "200",
              "$max_preemptions_per_min": "0"}
    for name, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def test_every_engine_panel_of_the_dashboard_returns_data(stack, workload):
    _, prometheus = stack
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            if "kvpilot_tuner" in target["expr"]:
                continue  # the tuner's own metrics: not built yet
            result = prometheus.query(substitute(target["expr"]))
            assert result, f"panel {panel['title']!r} ({target['refId']}) returned no data"
            values = [float(r["value"][1]) for r in result]
            assert all(math.isfinite(v) for v in values), (panel["title"], values)
            checked += 1
    assert checked >= 20
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric = substitute(variable["definition"].removeprefix("label_values(").rsplit(",", 1)[0])
            assert prometheus.query(metric), variable["name"]
