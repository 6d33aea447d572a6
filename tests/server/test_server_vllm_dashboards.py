"""vLLM's own Grafana dashboards (Overview, Instances, KV Cache, Service Status; shipped
unchanged by the chart) answer against a real `kvpilot serve` through a real Prometheus under
load, query by query: each panel query, with Grafana's variables substituted
(vllm_dashboard_panels.py), returns a sample over the load's window, or the table there says
why it cannot (a KV connector, LoRA, offloading...). A listed query that answers fails too.

The server runs with the flags the optional rows need (--enable-mfu-metrics, --kv-cache-metrics
sampling every block, prefix caching) and a 16-block cache, so that the load preempts, hits the
prefix cache, and evicts cached blocks (the KV residency histograms). Measured on the 2-core
Zen 4: about 60 s."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import ServerProcess, engine_flags, wait_until
from vllm_dashboard_panels import FILES, NOT_ANSWERING, queries, substitute, variable_values

from kvpilot.bench.harness.prometheus import Prometheus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETTINGS = {"max_model_len": 256, "max_num_seqs": 4, "num_gpu_blocks_override": 16, "block_size": 16,
            "dtype": "float32"}
FLAGS = ["--enable-prefix-caching", "--enable-mfu-metrics", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1"]
JOB = "vllm"


def hold_until_scraped(url: str, prometheus: Prometheus) -> None:
    """One long request at a time until a scrape has seen a request running and tokens counted:
    the Service Status dashboard's output speed divides by the 5 min average of
    vllm:num_requests_running and has no sample while every scrape saw 0 (as in vLLM); the
    short requests of `drive` can all fall between two 1 s scrapes on a loaded machine."""
    client = httpx.Client(base_url=url, timeout=180)
    seen = f'max_over_time(vllm:num_requests_running{{job="{JOB}"}}[5m]) > 0'
    for _ in range(5):
        client.post("/v1/completions", json={"prompt": "Count:", "max_tokens": 200,
                                             "ignore_eos": True}).raise_for_status()
        time.sleep(1.5)  # the scrape after it
        if prometheus.value(seen) is not None:
            return
    raise AssertionError(f"no scrape saw a request running in 5 tries: {seen}")


def drive(url: str) -> None:
    """Four concurrent 60-token prompts that must preempt (16 blocks of 16 tokens), one prompt
    three times (prefix-cache hits on the same blocks: reuse gaps), then new prompts that
    evict the cached blocks (lifetimes, idle times), a chat, a 400."""
    client = httpx.Client(base_url=url, timeout=180)
    words = " ".join(["word"] * 59)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: client.post("/v1/completions", json={
            "prompt": f"{i} {words}", "max_tokens": 24, "ignore_eos": True}).raise_for_status(), range(4)))
    for _ in range(3):
        client.post("/v1/completions", json={"prompt": "The same prefix " * 8, "max_tokens": 2}).raise_for_status()
        time.sleep(1.0)
    for i in range(3):
        client.post("/v1/completions", json={"prompt": f"{i} other " * 30, "max_tokens": 4}).raise_for_status()
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{(file, title, refId): answered} for every query, after the load."""
    workdir = tmp_path_factory.mktemp("vllm-dashboards")
    server = ServerProcess(workdir / "server.log", *engine_flags(**SETTINGS), *FLAGS)
    prometheus = Prometheus(workdir, [{"job_name": JOB, "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}])
    try:
        server.start()
        wait_until(lambda: prometheus.value(f'vllm:num_requests_running{{job="{JOB}"}}') is not None, 60, 0.5,
                   "the first scrape")
        start = time.time() - 2
        hold_until_scraped(server.url, prometheus)
        drive(server.url)
        time.sleep(3.0)  # the last samples scraped
        end = time.time()

        def label_values(match: str, label: str) -> list[str]:
            body = httpx.get(f"{prometheus.url}/api/v1/series", params={"match[]": match, "start": start,
                                                                         "end": end}, timeout=10).json()
            return sorted({s[label] for s in body["data"] if label in s})

        values = {file: variable_values(file, label_values) for file in FILES}
        found: dict = {}
        for key, expr in queries():
            result = prometheus.query_range(substitute(expr, values[key[0]], math.ceil(end - start)), start, end)
            answered = any(not math.isnan(float(v)) for series in result for _, v in series["values"])
            found[key] = found.get(key, True) and answered  # a key shared by panels: all must answer
        yield found
    finally:
        server.stop()
        prometheus.stop()


def test_every_panel_query_answers_or_the_table_says_why(answers):
    unanswered = {key for key, ok in answers.items() if not ok}
    assert unanswered - NOT_ANSWERING.keys() == set(), "queries that do not answer and are not in the table"
    assert NOT_ANSWERING.keys() & {key for key, ok in answers.items() if ok} == set(), "listed, yet they answer"
    assert len(answers) > 100 and len(unanswered) < len(answers) / 3


def test_the_table_names_only_queries_of_the_dashboards():
    keys = {key for key, _ in queries()}
    assert NOT_ANSWERING.keys() <= keys
    assert all(reason for reason in NOT_ANSWERING.values())
