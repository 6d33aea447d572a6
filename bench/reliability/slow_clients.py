"""`kvpilot bench slow-clients --connections 1000 --out benchmarks/results/reliability`:
slow and idle clients against a fresh `kvpilot serve` on loopback. Opens N connections that
send a chat request's headers (Content-Length: 100 kB) and the first byte of its body, then
nothing, plus N/10 that send nothing at all; records when the server closes each (and
whether it answered 408), while `/health` and a chat request are timed every 0.5 s from
another client. Prints a table and writes slow_clients.json.

`stall_and_probe` is shared with tests/server/test_server_slow_clients.py (a smaller N)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.engine.settings import to_flags
from kvpilot.engine.settings.env import VLLM_API_KEY
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.loadgen.process import KVPILOT_SERVE

API_KEY = "slow-clients-bench-key"
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0}


@dataclass
class SlowClientResult:
    """What the slow-client run saw: connections stalled (headers and one body byte) and idle
    (nothing sent), how many the server closed and after how long (s, from the connect), 408
    answers, those still open at the end, and the /health and chat latencies (s) and failures
    measured meanwhile."""

    stalled: int = 0  # connections opened that sent headers + 1 body byte
    idle: int = 0  # connections opened that sent nothing
    open_failures: int = 0
    closed_after_s: list[float] = field(default_factory=list)  # stalled ones, from their connect
    idle_closed_after_s: list[float] = field(default_factory=list)
    answered_408: int = 0
    still_open: int = 0  # not closed by the server within the wait
    health_s: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    chat_s: list[float] = field(default_factory=list)
    chat_failures: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """The JSON summary: the counts as they are, each list of seconds as its min/p50/max/n
        (rounded to ms), the first 10 failures of each kind."""
        def spread(values: list[float]) -> dict:
            if not values:
                return {}
            ordered = sorted(values)
            return {"min": round(ordered[0], 3), "p50": round(statistics.median(ordered), 3),
                    "max": round(ordered[-1], 3), "n": len(ordered)}

        out = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        out.update(closed=len(self.closed_after_s), closed_after_s=spread(self.closed_after_s),
                   idle_closed=len(self.idle_closed_after_s), idle_closed_after_s=spread(self.idle_closed_after_s),
                   health_s=spread(self.health_s), health_failures=self.health_failures[:10],
                   chat_s=spread(self.chat_s), chat_failures=self.chat_failures[:10])
        return out


def raise_open_file_limit(wanted: int) -> int:
    """Soft RLIMIT_NOFILE up to `wanted` (at most the hard limit); children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard if hard != resource.RLIM_INFINITY else wanted)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


async def _hold(host: str, port: int, request: bytes, result: SlowClientResult, wait_s: float) -> None:
    opened = time.monotonic()  # the server's timer starts at the connection (its first request)
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        result.open_failures += 1
        return
    if request:
        writer.write(request)
        await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(), wait_s)  # until the server closes
        closed = time.monotonic() - opened
        (result.closed_after_s if request else result.idle_closed_after_s).append(closed)
        result.answered_408 += data.startswith(b"HTTP/1.1 408")
    except (asyncio.TimeoutError, OSError):
        result.still_open += 1
    finally:
        writer.close()


async def _probe(url: str, path: str, record: list[float], failures: list[str], done: asyncio.Event) -> None:
    """GET /health or POST a chat request, every 0.5 s after the last answer, until done."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as client:
        while not done.is_set():
            t0 = time.monotonic()
            try:
                r = await (client.get(path) if path == "/health" else client.post(path, json=CHAT))
                if r.status_code == 200:
                    record.append(time.monotonic() - t0)
                else:
                    failures.append(f"{path}: HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                failures.append(f"{path}: {type(exc).__name__}")
            await asyncio.sleep(0.5)


async def stall_and_probe(url: str, stalled: int, idle: int, wait_s: float, body_bytes: int = 100_000) -> SlowClientResult:
    """Opens the stalled and idle connections (in batches of 100), probes meanwhile, and
    waits up to wait_s for the server to close each one."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {body_bytes}\r\n\r\n{{").encode()
    result = SlowClientResult(stalled=stalled, idle=idle)
    done = asyncio.Event()
    probers = [asyncio.create_task(_probe(url, "/health", result.health_s, result.health_failures, done)),
               asyncio.create_task(_probe(url, "/v1/chat/completions", result.chat_s, result.chat_failures, done))]
    tasks = []
    for i, request in enumerate([head] * stalled + [b""] * idle):
        tasks.append(asyncio.create_task(_hold(host, int(port), request, result, wait_s)))
        if i % 100 == 99:
            await asyncio.sleep(0.05)
    await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # one more round of probes after the last close
    done.set()
    await asyncio.gather(*probers)
    return result


def main(argv: list[str]) -> int:
    """`kvpilot bench slow-clients`: starts `kvpilot serve` with --request-read-timeout-s, holds
    --connections stalled connections (and a tenth as many idle ones) while probing /health and a
    chat, and writes slow_clients.json (with the machine block, kvpilot.loadgen.machine) under
    --out. Raises the open-file limit first. Returns 0."""
    p = argparse.ArgumentParser(prog="kvpilot bench slow-clients", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability"))
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--read-timeout-s", type=float, default=10.0, help="the server's --request-read-timeout-s")
    p.add_argument("--model", default="smollm2-135m-instruct")
    a = p.parse_args(argv)
    nofile = raise_open_file_limit(2 * a.connections + 512)
    os.environ[VLLM_API_KEY] = API_KEY
    engine = to_flags({"max_model_len": 256, "max_num_seqs": 4, "dtype": "float32", "num_gpu_blocks_override": 64})
    command = [*KVPILOT_SERVE, a.model, *engine, "--request-read-timeout-s", str(a.read_timeout_s),
               "--disable-log-requests", "--disable-uvicorn-access-log"]
    before = loadavg()
    with ServerProcess(command, Path("/tmp") / f"kvpilot-slow-clients-{os.getpid()}.log") as server:
        result = asyncio.run(stall_and_probe(server.base_url, a.connections, a.connections // 10,
                                             wait_s=a.read_timeout_s + 60))
    summary = {"server": " ".join(command[2:]), "machine": machine_info(loadavg_before=before),
               "open_file_limit": nofile, **result.summary(),
               "command": "kvpilot bench slow-clients " + " ".join(argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "slow_clients.json").write_text(json.dumps(summary, indent=1))
    print(f"{'connections stalled/idle':28} {a.connections}/{a.connections // 10} (read timeout {a.read_timeout_s:g} s)")
    for key in ("closed", "answered_408", "still_open", "open_failures", "idle_closed"):
        print(f"{key:28} {summary[key]}")
    for key in ("closed_after_s", "idle_closed_after_s", "health_s", "chat_s"):
        print(f"{key:28} {summary[key]}")
    print(f"{'health/chat failures':28} {len(result.health_failures)}/{len(result.chat_failures)}")
    return 0

