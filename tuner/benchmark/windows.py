"""One measured window of a scenario on the engine, on the path `kvpilot tune --local` runs a
trial: `LocalRunner.apply` brings the one `kvpilot serve` process to the point's settings (live
through /admin/scheduler_config when only scheduler limits change, else a restart), and
`WindowMeasurer.drive_window` confirms the engine reports them, warms up, waits for idle and
drives the window. What is kept per window is what any SLO needs later: each request's TTFT,
TPOT and every inter-token gap (client side), the server's preemptions and p95s, failures,
the duration, the engine's CPU seconds (kvpilot.loadgen.process.cpu_seconds) and the load
average ("loadavg", kvpilot.loadgen.machine's spelling)."""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any

from kvpilot.engine.settings import flag_words
from kvpilot.loadgen.machine import loadavg
from kvpilot.loadgen.process import cpu_seconds
from kvpilot.tuner.benchmark.scenarios import Scenario
from kvpilot.tuner.local.engine_process import EngineProcess
from kvpilot.tuner.local.runner import LocalRunner
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.cluster.remote_tokenizer import RemoteTokenizer
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.workload import Load, Workload

DEFAULT_MODEL = "smollm2-135m-instruct"


def open_runner(scenario: Scenario, model: str, log_path: Path) -> LocalRunner:
    """A LocalRunner for `scenario` (not started: the first `apply` starts the engine, with the
    scenario's KV blocks). Its load, one warm-up request and the window's requests, is built
    once the engine answers, with the engine's own tokenizer (its /tokenize, as the in-cluster
    tuner builds its load), so the client process loads neither transformers nor the model."""
    workload = Workload(num_requests=scenario.requests, request_rate=scenario.rate, warmup_requests=1,
                        ignore_eos=True)
    engine = EngineProcess(model, log_path, [*flag_words("num_gpu_blocks_override", scenario.kv_blocks),
                                             "--disable-log-requests"])
    name = model.removeprefix("builtin://")

    @functools.cache
    def load() -> Load:
        tokenizer = RemoteTokenizer(engine.base_url, name)
        try:
            return scenario.load(tokenizer)
        finally:
            tokenizer.close()

    return LocalRunner(engine, workload, load, SLO(), name)


def _none_if_nan(seconds: float) -> float | None:
    return None if math.isnan(seconds) else seconds


def measure_window(runner: LocalRunner, settings: EngineSettings) -> dict[str, Any]:
    """Brings the engine to `settings` and measures one window. Raises TrialFailed when the
    engine refuses the settings or stops answering (`LocalRunner`, `WindowMeasurer`)."""
    applied = runner.apply(settings)
    engine = runner.engine
    assert engine.proc is not None  # apply started it
    cpu0 = cpu_seconds(engine.proc.pid)
    window = runner.measurer.drive_window(engine.base_url, engine.headers, settings)
    ok = [r for r in window.results if r.success]
    return {"duration_s": window.duration_s, "failed": len(window.results) - len(ok),
            "preemptions": window.server.preemptions, "engine_cpu_s": round(cpu_seconds(engine.proc.pid) - cpu0, 2),
            "ttft_s": [round(r.ttft, 4) for r in ok],
            "tpot_s": [round((r.latency - r.ttft) / max(1, (r.output_tokens or 1) - 1), 5) for r in ok],
            "itl_s": [[round(x, 4) for x in r.itl] for r in ok],
            "itl_p95_server_s": _none_if_nan(window.server.itl_p95_s),
            "ttft_p95_server_s": _none_if_nan(window.server.ttft_p95_s),
            "applied": applied, "loadavg": loadavg(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
