"""The load run: requests sent on an arrival schedule, each streamed and timed, as vLLM's
`vllm bench serve` runs them (`benchmark()` and `get_request()` in vllm/benchmarks/serve.py).

`arrival_offsets` draws the send times (Poisson, gamma or periodic gaps); `run_benchmark`
sends every request at its time through `kvpilot.loadgen.request_client`, optionally capped
in concurrency, and returns the per-request results for `kvpilot.loadgen.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from kvpilot.loadgen.datasets import SampleRequest
from kvpilot.loadgen.metrics import RequestResult
from kvpilot.loadgen.request_client import RequestInput, endpoint_is_chat, send_request

DEFAULT_TIMEOUT_S = 6 * 60 * 60  # vLLM's per-request client timeout


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0, *, normalize: bool = True
) -> np.ndarray:
    """Send time of each request, in seconds after the benchmark starts (vLLM get_request).

    request_rate inf: all at 0. Otherwise the gaps (the first one included) are
    gamma(shape=burstiness, scale=1/(request_rate*burstiness)): mean 1/request_rate and
    coefficient of variation 1/sqrt(burstiness), so burstiness 1 is a Poisson process,
    < 1 burstier, > 1 more even, inf exactly periodic. Drawn from
    `numpy.random.RandomState(seed)`, the stream vLLM's `np.random.seed(seed)` gives. With
    `normalize` the schedule is scaled to end at num_requests/request_rate, as vLLM does
    to remove seed-to-seed throughput noise. Raises ValueError on non-positive rate or
    burstiness."""
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate}, {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = np.random.RandomState(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if normalize and num_requests and offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets


async def run_benchmark(
    requests: Sequence[SampleRequest],
    *,
    api_url: str,
    model: str,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request on the arrival schedule and wait for all; returns the results
    in request order and the benchmark duration (s, first send slot to last completion).
    With `max_concurrency`, a request that arrives while that many are in flight waits
    (its wait is `client_queue_time`)."""
    chat = endpoint_is_chat(api_url)
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 60.0), pool=None)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(req: SampleRequest, arrival: float) -> RequestResult:
            async with semaphore:
                result = await send_request(
                    client,
                    RequestInput(req.prompt, req.prompt_len, req.expected_output_len, model, api_url, chat,
                                 ignore_eos, dict(extra_body or {}), dict(headers or {})),
                    timeout_s=timeout_s,
                    on_done=lambda _: bar.update(1),
                )
            result.client_queue_time = result.start_time - arrival
            return result

        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, time.perf_counter())))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    bar.close()
    return results, duration
