"""The load a trial is measured under: ShareGPT (vLLM's benchmark sampling) or a replayed
trace, sent at a Poisson rate or a fixed concurrency with the serving benchmark's client
(`kvpilot.loadgen.benchmark.run_benchmark`), and judged per request against the SLOs with the
benchmark's `calculate_metrics` (vLLM's goodput definition).

A trace is JSONL, one request per line: {"timestamp": s, "prompt_len": tokens,
"output_len": tokens}; prompts are ShareGPT prompts cut to prompt_len tokens, and requests
are sent at the trace's timestamps (offsets from the first).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.loadgen.metrics import RequestResult, calculate_metrics
from kvpilot.loadgen.request_client import RequestInput, endpoint_is_chat, send_request
from kvpilot.tuner.search.objective import SLO, Measurement


@dataclass(frozen=True)
class Workload:
    """dataset: 'sharegpt' or a trace JSONL path. num_requests per window;
    request_rate: arrivals per second (inf: all at once), in gaps of a gamma process of shape
    `burstiness` (vLLM bench serve's --burstiness: 1 Poisson, < 1 burstier); max_concurrency caps
    requests in flight; max_output_len / max_prompt_len cap ShareGPT's lengths in tokens
    (short runs on CPU); ignore_eos makes every reply its requested length, so trials
    compare the same work; warmup_requests run before the window and are excluded."""

    dataset: str = "sharegpt"
    num_requests: int = 64
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_output_len: int | None = None
    max_prompt_len: int | None = None
    ignore_eos: bool = True
    warmup_requests: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    @property
    def is_trace(self) -> bool:
        """Whether `dataset` names a trace JSONL file (replayed at its timestamps) rather than ShareGPT."""
        return self.dataset != "sharegpt"


@dataclass(frozen=True)
class Load:
    """The requests of one window and, for a trace, their send offsets (s)."""

    requests: list[SampleRequest]
    offsets: list[float] | None = None


def _fit(requests: list[SampleRequest], w: Workload, max_model_len: int) -> list[SampleRequest]:
    out = []
    for r in requests:
        output = min(r.expected_output_len, w.max_output_len or r.expected_output_len)
        if w.max_prompt_len and r.prompt_len > w.max_prompt_len:
            continue
        if r.prompt_len + output <= max_model_len:
            out.append(SampleRequest(r.prompt, r.prompt_len, output))
    return out


def load_requests(tokenizer: Any, w: Workload, max_model_len: int, sharegpt_path: str | None = None) -> Load:
    """The window's requests (plus warm-up ones at the front), fitted to max_model_len.
    Raises ValueError when too few ShareGPT requests fit."""
    if w.is_trace:
        return _load_trace(tokenizer, Path(w.dataset), w, max_model_len, sharegpt_path)
    wanted = w.num_requests + w.warmup_requests
    size = wanted * 4
    while True:  # the length caps drop requests: sample more until enough fit
        pool = sample_sharegpt_requests(tokenizer, size, seed=w.seed, path=sharegpt_path, oversample=False)
        fitted = _fit(pool, w, max_model_len)
        if len(fitted) >= wanted or size >= 4096 or len(pool) < size:
            break
        size *= 4
    if len(fitted) < wanted:
        raise ValueError(f"only {len(fitted)} ShareGPT requests fit max_model_len {max_model_len}; need {wanted}")
    return Load(fitted[:wanted])


def _load_trace(tokenizer: Any, path: Path, w: Workload, max_model_len: int, sharegpt_path: str | None) -> Load:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    rows = rows[: w.num_requests]
    prompts = sample_sharegpt_requests(tokenizer, len(rows), seed=w.seed, path=sharegpt_path, output_len=1)
    requests, t0 = [], float(rows[0]["timestamp"])
    for row, source in zip(rows, prompts * (len(rows) // max(1, len(prompts)) + 1)):
        prompt_len = min(int(row["prompt_len"]), source.prompt_len)
        ids = tokenizer.encode(source.prompt, add_special_tokens=False)[:prompt_len]
        output = min(int(row["output_len"]), max(1, max_model_len - prompt_len))
        requests.append(SampleRequest(tokenizer.decode(ids), len(ids), output))
    warm = [SampleRequest(r.prompt, r.prompt_len, min(r.expected_output_len, 16))
            for r in requests[: w.warmup_requests]]
    return Load(warm + requests, [0.0] * len(warm) + [float(r["timestamp"]) - t0 for r in rows])


def client_measurement(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> Measurement:
    """Per-request goodput and latency percentiles from the client's timings."""
    metrics, _ = calculate_metrics(results, duration_s, percentiles=(95,), goodput_slos_ms=slo.goodput_slos_ms())
    p95 = {k: metrics.stats[k].percentiles[95.0] / 1000.0 if metrics.completed else math.nan
           for k in ("ttft", "itl", "tpot", "e2el")}
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    return Measurement(
        duration_s=duration_s, completed=metrics.completed, failed=metrics.failed,
        throughput_rps=metrics.request_throughput,
        goodput_rps=metrics.request_goodput if slo.goodput_slos_ms() else metrics.request_throughput,
        output_tokens_per_s=metrics.output_throughput, ttft_p95_s=p95["ttft"], itl_p95_s=p95["itl"],
        tpot_p95_s=p95["tpot"], e2e_p95_s=p95["e2el"], source="client",
        extra={"errors": errors, "latencies": {"ttft_s": [round(r.ttft, 4) for r in results if r.success],
                                               "e2e_s": [round(r.latency, 4) for r in results if r.success]}},
    )


async def _replay(requests: Sequence[SampleRequest], offsets: Sequence[float], api_url: str, model: str,
                  headers: dict[str, str], ignore_eos: bool) -> tuple[list[RequestResult], float]:
    chat = endpoint_is_chat(api_url)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=60.0)) as client:
        start = time.perf_counter()

        async def one(req: SampleRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            return await send_request(client, RequestInput(req.prompt, req.prompt_len, req.expected_output_len,
                                                           model, api_url, chat, ignore_eos, {}, dict(headers)))
        results = list(await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets))))
    return results, time.perf_counter() - start


def drive(requests: Sequence[SampleRequest], w: Workload, base_url: str, model: str,
          headers: dict[str, str] | None = None, offsets: Sequence[float] | None = None,
          request_rate: float | None = None) -> tuple[list[RequestResult], float]:
    """Sends `requests` to the server's /v1/completions and waits for all; returns the
    results and the duration (s). `request_rate` overrides the workload's (capacity search)."""
    api_url = base_url.rstrip("/") + "/v1/completions"
    if offsets is not None:
        return asyncio.run(_replay(requests, offsets, api_url, model, dict(headers or {}), w.ignore_eos))
    return asyncio.run(run_benchmark(
        requests, api_url=api_url, model=model, request_rate=request_rate or w.request_rate,
        burstiness=w.burstiness, max_concurrency=w.max_concurrency, seed=w.seed, ignore_eos=w.ignore_eos,
        headers=dict(headers or {}),
        progress=sys.stderr.isatty()))  # a bar per trial window on a terminal
