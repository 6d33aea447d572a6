"""`kvpilot bench fuzz-liveness --requests 2000 --out benchmarks/results/reliability`:
a fuzz that checks liveness, not only status codes. Against a fresh `kvpilot serve` on
loopback (admin routes on), it sends generated requests over every route of the server's
OpenAPI document (fuzz_cases.py: schemathesis + hostile values), one at a time, and after
each one checks that `/health` answers 200 and (every `--canary-every` requests; 1 by
default) that a canary chat request completes. An engine death is any request after which
either check fails. At the end the engine must be idle with every KV block free. Prints a
table and writes fuzz_liveness.json.

`run_fuzz` is shared with tests/server/test_server_fuzz_liveness.py (fewer requests)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.bench.reliability.fuzz_cases import FuzzCase, fuzz_cases
from kvpilot.bench.reliability.probes import openai_error_shape
from kvpilot.bench.reliability.run import metric, wait_idle
from kvpilot.engine.settings import LIVE_SETTINGS, to_flags
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.loadgen.process import KVPILOT_SERVE

API_KEY = "fuzz-liveness-key"
ADMIN_TOKEN = "fuzz-liveness-admin-token"
CANARY = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0}
NUM_BLOCKS = 64
CANARY_ATTEMPTS = 3


@dataclass
class LivenessResult:
    """What the liveness fuzz saw: requests sent and their routes, kinds and statuses; the
    labels of 5xx answers (other than 503 with Retry-After), 4xx/5xx JSON not in OpenAI's error
    shape, timeouts, dropped connections and requests after which the server stopped answering;
    health checks, canaries (each one's seconds) and the run's length (s)."""

    sent: int = 0
    routes: Counter = field(default_factory=Counter)  # "METHOD /path" -> requests
    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # 5xx other than 503 with Retry-After
    bad_error_shape: list[str] = field(default_factory=list)  # 4xx/5xx JSON not in OpenAI's shape
    unanswered: list[str] = field(default_factory=list)
    connection_errors: list[str] = field(default_factory=list)  # the request's connection failed
    engine_deaths: list[str] = field(default_factory=list)  # the request after which liveness failed
    health_checks: int = 0
    canaries: int = 0
    canary_retries: int = 0  # canaries asked again after a 408 (deadline) or 503 (busy)
    canary_s: list[float] = field(default_factory=list)
    seconds: float = 0.0


def headers_for(path: str) -> dict[str, str]:
    """The Authorization header for `path`: the admin token on /admin/ routes, the API key elsewhere."""
    token = ADMIN_TOKEN if path.startswith("/admin/") else API_KEY
    return {"Authorization": f"Bearer {token}"}


def send(client: httpx.Client, case: FuzzCase, result: LivenessResult, timeout_s: float) -> None:
    """Sends one fuzz case and counts its outcome in `result`: a timeout (after `timeout_s` s) is
    unanswered, a transport error a connection error, a 5xx other than 503 with Retry-After a
    server error, a 4xx/5xx JSON answer not in OpenAI's shape a bad error shape. Raises nothing
    for the server's answers."""
    headers = headers_for(case.path)
    if case.content_type or case.has_json:
        headers["Content-Type"] = case.content_type or "application/json"
    label = f"{case.method} {case.path} [{case.kind}] {(case.content() or b'')[:200]!r}"
    try:
        r = client.request(case.method, case.path, content=case.content(), params=case.params, headers=headers,
                           timeout=timeout_s)
    except httpx.TimeoutException:
        result.unanswered.append(label)
        return
    except httpx.TransportError as exc:  # the liveness check after it tells whether the server is still there
        result.connection_errors.append(f"{label}: {type(exc).__name__}")
        return
    result.statuses[r.status_code] += 1
    if r.status_code >= 500 and not (r.status_code == 503 and "retry-after" in r.headers):
        result.server_errors.append(f"{label} -> {r.status_code} {r.text[:200]}")
    json_answer = r.headers.get("content-type", "").startswith("application/json")
    if r.status_code >= 400 and json_answer and not openai_error_shape(r):
        result.bad_error_shape.append(f"{label} -> {r.status_code} {r.text[:200]}")


def alive(client: httpx.Client, result: LivenessResult, canary: bool) -> str | None:
    """None when /health is 200 and (if asked) the canary chat completes; else why not.
    /health goes over a new connection each time, as the kubelet's probe does."""
    try:
        result.health_checks += 1
        base = str(client.base_url).rstrip("/")
        health = httpx.get(f"{base}/health", timeout=10)
        if health.status_code != 200:
            return f"/health {health.status_code} {health.text[:200]}"
        if canary:
            result.canaries += 1
            for attempt in range(CANARY_ATTEMPTS):  # 408/503 or a dropped keep-alive: not dead; ask again
                t0 = time.monotonic()
                try:
                    r = httpx.post(f"{base}/v1/chat/completions", json=CANARY,
                                   headers=headers_for("/v1"), timeout=60)
                except httpx.TransportError:
                    if attempt == CANARY_ATTEMPTS - 1:
                        raise
                    result.canary_retries += 1
                    continue
                if r.status_code not in (408, 503) or attempt == CANARY_ATTEMPTS - 1:
                    break
                result.canary_retries += 1
            if r.status_code != 200 or not isinstance(r.json()["choices"][0]["message"]["content"], str):
                return f"canary {r.status_code} {r.text[:200]}"
            result.canary_s.append(time.monotonic() - t0)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def run_fuzz(url: str, cases: list[FuzzCase], canary_every: int = 1, timeout_s: float = 60.0,
             progress: bool = False, time_limit_s: float | None = None) -> LivenessResult:
    """Sends the cases one at a time with a liveness check after each; stops after an
    engine death that the server does not recover from within 30 s, or (when given)
    once time_limit_s has passed (`sent` says how many went)."""
    result = LivenessResult()
    t0 = time.monotonic()
    with httpx.Client(base_url=url) as client:
        admin = headers_for("/admin/")
        scheduler = client.get("/admin/scheduler_config", headers=admin).json()
        live = {k: scheduler[k] for k in LIVE_SETTINGS}
        for i, case in enumerate(cases):
            if time_limit_s is not None and time.monotonic() - t0 > time_limit_s:
                break
            result.sent += 1
            result.routes[f"{case.method} {case.path}"] += 1
            result.kinds[case.kind] += 1
            send(client, case, result, timeout_s)
            if case.method == "POST" and case.path == "/admin/scheduler_config":
                # a valid change stands until here (max_num_batched_tokens 1 is legal, and slow); then
                # the next requests get the server's own limits back
                client.post("/admin/scheduler_config", json=live, headers=admin)
            why = alive(client, result, canary=(i + 1) % canary_every == 0)
            if progress and (i + 1) % 100 == 0:
                print(f"{i + 1}/{len(cases)} sent, {len(result.engine_deaths)} engine deaths, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
            if why is not None:
                result.engine_deaths.append(f"after {case.method} {case.path} [{case.kind}] "
                                            f"{(case.content() or b'')[:300]!r}: {why}")
                end = time.monotonic() + 30
                while alive(client, result, canary=True) is not None:
                    if time.monotonic() > end:
                        result.seconds = time.monotonic() - t0
                        return result
                    time.sleep(1)
    result.seconds = time.monotonic() - t0
    return result


def leaked_blocks(url: str, num_blocks: int) -> tuple[int, float]:
    """(KV blocks still in use once idle, requests still running)."""
    usage, running = wait_idle(url)
    return round(usage * num_blocks), running


def server_command(model: str, max_model_len: int) -> list[str]:
    """`kvpilot serve MODEL` as the fuzz runs it: float32, 4 sequences, NUM_BLOCKS KV blocks, a
    16-deep queue, 20 s request deadline, admin routes on, request logging off (ServerProcess
    appends --port)."""
    engine = to_flags({"max_model_len": max_model_len, "max_num_seqs": 4, "dtype": "float32",
                       "num_gpu_blocks_override": NUM_BLOCKS})
    return [*KVPILOT_SERVE, model, *engine, "--max-queue-len", "16", "--request-deadline-s", "20",
            "--enable-admin-routes", "--disable-log-requests", "--disable-uvicorn-access-log"]


def summary(result: LivenessResult, blocks: int, running: float) -> dict:
    """The JSON summary of a fuzz run: counts by route, kind and status, the first 20 of each
    failure list, canary p50/max (s), and `blocks` KV blocks leaked and `running` requests still
    running after the run."""
    canary = sorted(result.canary_s)
    return {"requests": result.sent, "routes": dict(result.routes), "kinds": dict(result.kinds),
            "statuses": {str(k): v for k, v in sorted(result.statuses.items())},
            "engine_deaths": len(result.engine_deaths), "engine_death_details": result.engine_deaths[:20],
            "server_errors": result.server_errors[:20], "num_server_errors": len(result.server_errors),
            "bad_error_shape": result.bad_error_shape[:20], "unanswered": result.unanswered[:20],
            "connection_errors": result.connection_errors[:20], "num_connection_errors": len(result.connection_errors),
            "health_checks": result.health_checks, "canaries": result.canaries,
            "canary_retries": result.canary_retries,
            "canary_p50_s": round(canary[len(canary) // 2], 3) if canary else None,
            "canary_max_s": round(canary[-1], 3) if canary else None,
            "kv_blocks_leaked": blocks, "running_after": running, "seconds": round(result.seconds, 1)}


def main(argv: list[str]) -> int:
    """`kvpilot bench fuzz-liveness`: starts `kvpilot serve`, sends --requests fuzz cases with a
    liveness check (and canary chat) after each --canary-every, then checks the KV cache is idle;
    writes fuzz_liveness.json (with the machine block, kvpilot.loadgen.machine) under --out.
    Returns 0, or 1 when the engine died or KV blocks leaked."""
    p = argparse.ArgumentParser(prog="kvpilot bench fuzz-liveness", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability"))
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--canary-every", type=int, default=1)
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--max-size", type=int, default=1_000_000, help="largest hostile array or string")
    p.add_argument("--time-limit-s", type=float, default=None, help="stop sending after this long")
    p.add_argument("--model", default="smollm2-135m-instruct")
    a = p.parse_args(argv)
    os.environ.update(VLLM_API_KEY=API_KEY, KVPILOT_ADMIN_TOKEN=ADMIN_TOKEN)
    command = server_command(a.model, a.max_model_len)
    before = loadavg()
    with ServerProcess(command, Path("/tmp") / f"kvpilot-fuzz-liveness-{os.getpid()}.log") as server:
        cases = fuzz_cases(httpx.get(f"{server.base_url}/openapi.json").json(), a.requests, seed=a.seed,
                           max_size=a.max_size)
        result = run_fuzz(server.base_url, cases, canary_every=a.canary_every, progress=True,
                          time_limit_s=a.time_limit_s)
        blocks, running = leaked_blocks(server.base_url, NUM_BLOCKS)
        errors = metric(server.base_url, 'vllm:request_success_total{engine="0",finished_reason="error"')
        alive_at_end = server.proc.poll() is None
    out = {"server": " ".join(command[2:]), "machine": machine_info(loadavg_before=before),
           **summary(result, blocks, running), "request_errors_counted": errors, "process_alive_at_end": alive_at_end,
           "command": "kvpilot bench fuzz-liveness " + " ".join(argv)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fuzz_liveness.json").write_text(json.dumps(out, indent=1))
    for key in ("requests", "engine_deaths", "num_server_errors", "kv_blocks_leaked", "health_checks", "canaries",
                "canary_retries", "canary_p50_s", "seconds", "process_alive_at_end"):
        print(f"{key:22} {out[key]}")
    print(f"{'unanswered':22} {len(result.unanswered)}")
    print(f"{'bad error shape':22} {len(result.bad_error_shape)}")
    print(f"{'statuses':22} {out['statuses']}")
    print(f"{'routes':22} {out['routes']}")
    return 0 if not result.engine_deaths and blocks == 0 else 1

