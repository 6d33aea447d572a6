"""`kvpilot bench serve` against a live `kvpilot serve` (the builtin SmolLM2 model) with
real ShareGPT requests: the saved result file has vLLM's keys, and its counts equal what
the server's Prometheus counters moved by during the same run."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.bench import serve
from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.loadgen.datasets import is_valid_sequence, iter_sharegpt, token_ids_batch
from kvpilot.loadgen.process import KVPILOT_SERVE

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8
MAX_PROMPT_TOKENS = 256
MAX_REPLY_TOKENS = 32  # max_tokens is the reference reply's length: short replies keep the run to seconds
COUNTERS = ("vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens")

# The keys `vllm bench serve --save-result` writes (without --save-detailed), ttft/tpot/itl
# statistics at vLLM's default p99 and ours p90/p95, plus e2el which we select by default.
VLLM_RESULT_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p95", "p99")),
]


@pytest.fixture(scope="module")
def short_sharegpt(tmp_path_factory, smollm2_tokenizer) -> tuple[Path, list[int]]:
    """A ShareGPT file of the first NUM_PROMPTS conversations of the real data set (file
    order) that pass vLLM's filter with a prompt of at most MAX_PROMPT_TOKENS and a
    reference reply of at most MAX_REPLY_TOKENS tokens, and those replies' lengths."""
    picked, reply_lens = [], []
    for entry in iter_sharegpt():
        turns = entry.get("conversations") or []
        if len(turns) < 2:
            continue
        prompt_ids, reply_ids = token_ids_batch(smollm2_tokenizer, [turns[0]["value"], turns[1]["value"]])
        if (is_valid_sequence(len(prompt_ids), len(reply_ids)) and len(prompt_ids) <= MAX_PROMPT_TOKENS
                and len(reply_ids) <= MAX_REPLY_TOKENS):
            picked.append(entry)
            reply_lens.append(len(reply_ids))
            if len(picked) == NUM_PROMPTS:
                break
    path = tmp_path_factory.mktemp("sharegpt") / "short.json"
    path.write_text(json.dumps(picked))
    return path, reply_lens


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """`kvpilot serve` on the builtin model, small enough for the 2-core CI machine."""
    log = tmp_path_factory.mktemp("live") / "server.log"
    flags = ["--max-model-len", "512", "--max-num-seqs", "8", "--num-gpu-blocks-override", "128",
             "--dtype", "bfloat16", "--disable-log-requests", "--disable-uvicorn-access-log"]
    with ServerProcess([*KVPILOT_SERVE, "smollm2-135m-instruct", "--host", "127.0.0.1", *flags], log,
                       startup_timeout_s=300) as server:
        yield server


def counter_totals(base_url: str) -> dict[str, dict[str, float]]:
    """{counter name: {finished_reason or "": value}} for COUNTERS, from the server's
    /metrics parsed by prometheus_client's own text parser."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    totals: dict[str, dict[str, float]] = {name: {} for name in COUNTERS}
    for family in text_string_to_metric_families(text):
        if family.name not in totals:
            continue
        for sample in family.samples:
            if sample.name == family.name + "_total":
                reason = sample.labels.get("finished_reason", "")
                totals[family.name][reason] = totals[family.name].get(reason, 0.0) + sample.value
    return totals


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_result_counts_match_the_servers_prometheus_counters(endpoint, live_server, short_sharegpt, tmp_path, capsys):
    path, reply_lens = short_sharegpt
    assert len(reply_lens) == NUM_PROMPTS
    before = counter_totals(live_server.base_url)
    assert all(before[name] for name in COUNTERS), f"counters missing from /metrics: {before}"

    code = serve.main(["--base-url", live_server.base_url, "--endpoint", endpoint, "--dataset-path", str(path),
                       "--disable-shuffle", "--num-prompts", str(NUM_PROMPTS), "--request-rate", "20", "--seed", "0",
                       "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
                       "--result-filename", "run.json", "--disable-tqdm"])
    after = counter_totals(live_server.base_url)
    assert code == 0, capsys.readouterr()

    data = json.loads((tmp_path / "run.json").read_text())
    assert [k for k in VLLM_RESULT_KEYS if k not in data] == []
    backend = {"completions": "openai", "chat": "openai-chat"}[endpoint]
    assert (data["backend"], data["model_id"], data["num_prompts"]) == (backend, "smollm2-135m-instruct", NUM_PROMPTS)

    delta = {name: {k: after[name][k] - before[name].get(k, 0.0) for k in after[name]} for name in COUNTERS}
    assert data["failed"] == 0, data["error_counts"]
    assert data["completed"] == NUM_PROMPTS
    assert data["completed"] == sum(delta["vllm:request_success"].values()), delta
    assert delta["vllm:request_success"].get("abort", 0.0) == 0
    assert data["total_input_tokens"] == delta["vllm:prompt_tokens"][""]
    assert data["total_output_tokens"] == delta["vllm:generation_tokens"][""]

    # per request: every reply stopped at its max_tokens (the reference length) or earlier,
    # and the lists add up to the totals
    assert all(0 < out <= ref for out, ref in zip(data["output_lens"], reply_lens))
    assert sum(data["output_lens"]) == data["total_output_tokens"]
    assert sum(data["input_lens"]) == data["total_input_tokens"]
    assert len(data["ttfts"]) == NUM_PROMPTS and all(t > 0 for t in data["ttfts"])
    assert data["mean_ttft_ms"] > 0 and data["duration"] > 0
