"""`kvpilot bench reliability --out benchmarks/results/reliability`: the
reliability benchmark at full size against a fresh `kvpilot serve` on loopback: API fuzz
(>= 1,000 generated requests), overload at 10x capacity, a storm of 100 streams closed
mid-generation, SIGTERM under streaming load. Writes results.json and README.md (a table
with every figure, the load average and the CPU beside it).

Capacity here is what the server admits at once: running slots (--max-num-seqs) plus the
waiting queue (--max-queue-len); more than that is answered 503 with Retry-After."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx

from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.bench.reliability.probes import disconnect_storm, fuzz, generate_requests, overload
from kvpilot.engine.settings import BY_NAME, to_flags
from kvpilot.engine.settings.env import VLLM_API_KEY
from kvpilot.loadgen.machine import machine_info
from kvpilot.loadgen.process import KVPILOT_SERVE

API_KEY = "reliability-bench-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def server_command(a: argparse.Namespace) -> list[str]:
    """`kvpilot serve` as the reliability run starts it: float32, 256 KV blocks, the flags' model
    length, sequences, queue length and request deadline (s), request logging off."""
    engine = {"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs, "num_gpu_blocks_override": 256,
              "dtype": "float32"}
    return [*KVPILOT_SERVE, a.model, *to_flags(engine), "--max-queue-len", str(a.max_queue_len),
            "--request-deadline-s", str(a.deadline_s), "--disable-log-requests", "--disable-uvicorn-access-log"]


def metric(url: str, name: str) -> float:
    """The sum over every series of Prometheus metric `name` on the server's /metrics (0.0 when
    absent). Raises httpx.HTTPError when /metrics does not answer within 10 s."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, timeout_s: float = 60.0) -> tuple[float, float]:
    """(kv_cache_usage_perc, num_requests_running) once both are 0, or as they are at the timeout."""
    end = time.monotonic() + timeout_s
    while True:
        usage, running = metric(url, "vllm:kv_cache_usage_perc"), metric(url, "vllm:num_requests_running")
        if (usage == 0 and running == 0) or time.monotonic() > end:
            return usage, running
        time.sleep(0.5)


async def sigterm_under_load(server: ServerProcess, streams: int) -> dict:
    """Opens `streams` streams, sends SIGTERM once all have produced a token, and classifies
    every one: completed ([DONE] after a finish_reason), told (an error event), or lost
    (the connection ended with neither)."""
    outcome = {"completed": 0, "told": 0, "lost": 0, "refused": 0}
    first_tokens = asyncio.Event()
    count = 0
    body = {"prompt": "Tell me about the sea.", "max_tokens": 48, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as client:
        async def one() -> None:
            nonlocal count
            finished = errored = done = False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        outcome["refused"] += 1
                        return
                    seen = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if not seen:
                            seen, count = True, count + 1
                            if count == streams:
                                first_tokens.set()
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                        elif "error" in (event := json.loads(data)):
                            errored = True
                        elif any(c.get("finish_reason") for c in event.get("choices", ())):
                            finished = True
            except httpx.HTTPError:
                pass
            outcome["completed" if finished and done else "told" if errored else "lost"] += 1

        tasks = [asyncio.create_task(one()) for _ in range(streams)]
        try:
            await asyncio.wait_for(first_tokens.wait(), 120)
        except asyncio.TimeoutError:
            pass
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    outcome["exit_code"] = server.proc.wait(60)
    return outcome


def run(a: argparse.Namespace) -> dict:
    """Starts `kvpilot serve` and runs the four probes in order: the OpenAPI fuzz, an overload of
    10 x capacity (running + queued), the disconnect storm, SIGTERM under load; returns their
    figures with the machine block (kvpilot.loadgen.machine, the load before and after). Raises
    ServerRefused when the server does not start."""
    os.environ[VLLM_API_KEY] = API_KEY
    capacity = a.max_num_seqs + a.max_queue_len
    results: dict = {"capacity": capacity, "machine": machine_info()}
    with ServerProcess(server_command(a), Path("/tmp") / f"kvpilot-reliability-{os.getpid()}.log") as server:
        url = server.base_url
        openapi = httpx.get(f"{url}/openapi.json").json()
        t0 = time.monotonic()
        f = asyncio.run(fuzz(url, HEADERS, generate_requests(openapi, a.fuzz_requests, seed=17), concurrency=4,
                             timeout_s=a.deadline_s + 30))
        results["fuzz"] = {"requests": f.requests, "statuses": dict(f.statuses), "server_errors": f.server_errors,
                           "overloaded_503_with_retry_after": f.overloaded,
                           "unanswered": f.unanswered, "bad_error_shape": f.bad_error_shape,
                           "seconds": round(time.monotonic() - t0, 1)}
        results["fuzz"]["kv_after"] = wait_idle(url)
        o = asyncio.run(overload(url, HEADERS, offered=10 * capacity, pid=server.proc.pid))
        results["overload"] = {"offered": o.offered, "statuses": dict(o.statuses), "missing_retry_after":
                               o.missing_retry_after, "health_probes": o.health_probes, "health_failures":
                               o.health_failures, "health_errors": o.health_errors, "peak_rss_mib": round(o.peak_rss_bytes / 2**20),
                               "seconds": round(o.duration_s, 1), "kv_after": wait_idle(url)}
        closed, waves = 0, 0
        while closed < a.storm_streams and waves < 4 * a.storm_streams // capacity + 4:  # waves of capacity
            waves += 1
            closed += asyncio.run(disconnect_storm(url, HEADERS, streams=min(capacity, a.storm_streams - closed),
                                                   max_tokens=a.max_model_len // 2))
        results["storm"] = {"closed_mid_stream": closed, "kv_after": wait_idle(url),
                            "waiting_after": metric(url, "vllm:num_requests_waiting")}
        results["sigterm"] = asyncio.run(sigterm_under_load(server, a.sigterm_streams))
    results["machine"] = machine_info(loadavg_before=results["machine"]["loadavg"])
    return results


def main(argv: list[str]) -> int:
    """`kvpilot bench reliability`: `run` with the flags' server limits, written to results.json
    under --out and printed. Returns 0."""
    p = argparse.ArgumentParser(prog="kvpilot bench reliability", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(BY_NAME["max_model_len"].flag, type=int, default=256)
    p.add_argument(BY_NAME["max_num_seqs"].flag, type=int, default=4)
    p.add_argument("--max-queue-len", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=5.0)
    p.add_argument("--fuzz-requests", type=int, default=1000)
    p.add_argument("--storm-streams", type=int, default=100)
    p.add_argument("--sigterm-streams", type=int, default=12)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    results = run(a)
    results["command"] = "kvpilot bench reliability " + " ".join(argv)
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "fuzz"}, indent=1))
    print(json.dumps({k: v for k, v in results["fuzz"].items() if k in ("requests", "statuses", "seconds")}))
    return 0

