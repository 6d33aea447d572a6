"""`kvpilot serve MODEL [flags]`: the OpenAI-compatible server, with `vllm serve`'s flags.

The port opens at once and /health answers 503 until the model has loaded. SIGTERM
drains: /health and new requests get 503, accepted requests run to completion (at most
--drain-timeout seconds, then they are aborted), and the process exits 0. SIGINT stops
at once. Exit codes (kvpilot.engine.exit_codes, with a JSON line on stderr): 0 after a
shutdown, 2 for bad flags or settings, 3 when the KV cache cannot hold one max_model_len
sequence, 4 out of memory while loading, 1 for any other load failure, 5 when the engine
loop died while serving (the process exits at once rather than answer 503 forever, as
vLLM's server shuts down on EngineDeadError; one request's own error never does this).

Several nodes (`--nnodes N`): node 0 (`--node-rank 0`) runs this server and the driver; its
/health answers 200 only once every rank of every node has joined and loaded, and turns 503
(then the process exits 5) when a rank on any node is gone. Every other node runs headless
(engine/executor/headless.py), implied by `--node-rank` > 0 (vLLM needs `--headless` there; kvpilot
accepts it), so one pod template with `--node-rank <pod index>` serves every node."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping

import uvicorn

from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.entrypoints.openai.api_server import build_app
from kvpilot.engine.engine.async_engine import AsyncLLMEngine
from kvpilot.engine.engine.engine_thread import EngineThread
from kvpilot.engine.entrypoints.http_protocol import guarded_h11_protocol
from kvpilot.engine.metrics.engine_metrics import EngineMetrics
from kvpilot.engine.metrics.options import MetricOptions
from kvpilot.engine.entrypoints.openai.serving import ServerState
from kvpilot.engine.exit_codes import (
    EXIT_BAD_ARGS,
    EXIT_ENGINE_DIED,
    EXIT_FAILED,
    EXIT_KV_CACHE_TOO_SMALL,
    EXIT_OUT_OF_MEMORY,
    KVCacheTooSmallError,
    report_failure,
)
from kvpilot.engine.executor.headless import run_headless
from kvpilot.engine.engine.llm_engine import LLMEngine
from kvpilot.engine.settings import BY_NAME
from kvpilot.engine.settings.cli_args import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    KEEP_ALIVE_ENV,
    PROFILER_DIR_ENV,
    make_serve_parser,
)

logger = logging.getLogger("kvpilot.server")

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def make_parser() -> argparse.ArgumentParser:
    """The `kvpilot serve` argument parser (kvpilot.engine.settings.cli_args.make_serve_parser)."""
    return make_serve_parser()


def load_failure_code(exc: BaseException) -> int:
    """The exit code (kvpilot.engine.exit_codes) for an engine that failed to load with exc."""
    if isinstance(exc, KVCacheTooSmallError):
        return EXIT_KV_CACHE_TOO_SMALL
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
        return EXIT_OUT_OF_MEMORY
    return EXIT_FAILED


def resolve_secrets(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                    env: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(api_key, admin_token). The key comes from --api-key, else $VLLM_API_KEY; unset means
    no authentication, but an empty key is a mistake (a Secret with an empty value) and exits 2
    rather than silently serving without auth. Surrounding whitespace is not part of the key:
    a key file made with `openssl rand -hex -out f 24` or `echo` ends with a newline, which
    `kubectl create secret --from-file` keeps and an Authorization header cannot carry.
    --enable-admin-routes needs $KVPILOT_ADMIN_TOKEN."""
    api_key = ns.api_key if ns.api_key is not None else env.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        parser.error(f"the API key is empty (--api-key or ${API_KEY_ENV}); set a key, or unset both to serve "
                     "without authentication")
    api_key = api_key.strip() if api_key is not None else None
    admin_token = None
    if ns.enable_admin_routes:
        admin_token = env.get(ADMIN_TOKEN_ENV) or ""
        if len(admin_token.strip()) < 16:
            parser.error(f"--enable-admin-routes needs ${ADMIN_TOKEN_ENV} set to a token of at least 16 characters")
        if admin_token == api_key:
            parser.error(f"${ADMIN_TOKEN_ENV} must differ from the API key: the admin routes need their own token")
    return api_key, admin_token


def freeze_gc_heap() -> int:
    """Moves every object alive now (model, tokenizer, engine: ~364,000 for SmolLM2) into the
    garbage collector's permanent generation, as vLLM does once its server has started
    (`freeze_gc_heap`): the full collections a long-running server still triggers then skip
    them. One full collection over them took ~180 ms on the AVX2 EPYC, a stall of every stream
    in flight (section 13 of `git show bbe6366:benchmarks/results/throughput/README.md`). Frozen objects are still freed by reference
    counting. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: the engine loads after the port opens, and SIGTERM drains."""

    def __init__(self, config: uvicorn.Config, state: ServerState, engine_config: EngineConfig,
                 ns: argparse.Namespace) -> None:
        super().__init__(config)
        self.state = state
        self.engine_config = engine_config
        self.ns = ns
        self.exit_code = 0
        self._tasks: set[asyncio.Task] = set()

    async def startup(self, sockets=None) -> None:
        """uvicorn's startup (the port opens, /health answers 503), then loads the engine in the background."""
        await super().startup(sockets)
        self._spawn(self._load())

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _load(self) -> None:
        t0 = time.monotonic()
        try:
            thread = EngineThread()  # builds the engine, then runs its loop (engine_thread.py)
            engine = await asyncio.wrap_future(thread.submit(LLMEngine, self.engine_config))
        except Exception as exc:
            logger.exception("the engine failed to load")
            self.exit_code = report_failure(load_failure_code(exc), f"{type(exc).__name__}: {exc}")
            self.should_exit = True
            return
        engine.detokenize_incrementally = True  # streams need each step's new text
        logger.info("froze %d objects alive after loading out of the garbage collector's reach", freeze_gc_heap())
        bm = engine.block_manager
        metrics = EngineMetrics(engine.config, bm.num_blocks, bm.num_swap_blocks, registry=self.state.metrics_registry,
                                options=MetricOptions.from_cli_args(self.ns))
        bm.residency = metrics.optional.residency  # --kv-cache-metrics: the block manager feeds vllm:kv_block_*
        async_engine = AsyncLLMEngine(engine, metrics, log_stats=not self.ns.disable_log_stats,
                                      stats_interval_s=self.ns.log_stats_interval)
        async_engine.on_dead = self._engine_died
        async_engine.start(asyncio.get_running_loop(), thread)
        self.state.tokenizer = engine.tokenizer
        self.state.max_model_len = engine.config.scheduler.max_model_len  # --max-model-len auto: as sized
        self.state.engine = async_engine
        logger.info("engine loaded in %.1f s; serving %r (max_model_len %d) on http://%s:%d",
                    time.monotonic() - t0, self.state.served_model_name, self.state.max_model_len,
                    self.config.host, self.config.port)

    def _engine_died(self, exc: BaseException) -> None:
        """The engine loop stopped with its shared state unknown: its streams have their
        errors; exit non-zero now, the reason on stderr, so the kubelet restarts the pod at
        once instead of after its liveness probe's failures."""
        self.exit_code = report_failure(EXIT_ENGINE_DIED, f"the engine loop failed: {type(exc).__name__}: {exc}")
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler: a first SIGTERM drains; a later one or SIGINT stops serving, one more forces it."""
        if sig == signal.SIGTERM and not self.state.draining and not self.should_exit:
            # Not recorded in _captured_signals: uvicorn would re-raise it at exit, and a
            # drained server must exit 0.
            self.state.draining = True
            self._spawn(self._drain())
            return
        if sig == signal.SIGTERM or sig == signal.SIGINT:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        state = self.state
        logger.info("SIGTERM: draining %d request(s) in flight (at most %.0f s); new requests get 503",
                    state.num_in_flight, self.ns.drain_timeout)
        deadline = time.monotonic() + self.ns.drain_timeout
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.num_in_flight and state.engine is not None and state.engine.is_running:
            logger.warning("drain timeout: aborting %d request(s) still in flight", state.num_in_flight)
            await state.engine.abort_all("aborted: the server shut down (drain timeout)")
            end = time.monotonic() + 2.0
            while state.num_in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        logger.info("drained; shutting down")
        self.should_exit = True


def check_http_limits(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Exit 2 for a slow-client limit out of range (kvpilot.engine.settings.cli_args.add_http_limit_args)."""
    if ns.timeout_keep_alive is None:
        try:
            ns.timeout_keep_alive = int(os.environ.get(KEEP_ALIVE_ENV, "5"))
        except ValueError:
            parser.error(f"${KEEP_ALIVE_ENV} must be a whole number of seconds, got {os.environ[KEEP_ALIVE_ENV]!r}")
    for flag, value, low in (("--request-read-timeout-s", ns.request_read_timeout_s, 0),
                             ("--timeout-keep-alive", ns.timeout_keep_alive, 1),
                             ("--limit-concurrency", ns.limit_concurrency, 1),
                             ("--h11-max-incomplete-event-size", ns.h11_max_incomplete_event_size, 1024),
                             ("--h11-max-header-count", ns.h11_max_header_count, 1)):
        if value is not None and value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")


def check_headless(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Exit 2 for --headless on node 0, which runs the scheduler and the HTTP server."""
    if ns.headless and ns.node_rank == 0:
        parser.error(f"{BY_NAME['headless'].flag} runs no HTTP server, but node 0 runs the scheduler and the server: "
                     f"drop {BY_NAME['headless'].flag} here, or give this node {BY_NAME['node_rank'].flag} "
                     f"{'1' if ns.nnodes <= 2 else f'1 to {ns.nnodes - 1}'}")


def http_limits(ns: argparse.Namespace) -> dict:
    """uvicorn.Config arguments for the slow-client limits (engine/entrypoints/http_protocol.py)."""
    return {"http": guarded_h11_protocol(ns.request_read_timeout_s or None, ns.h11_max_header_count),
            "timeout_keep_alive": ns.timeout_keep_alive, "limit_concurrency": ns.limit_concurrency,
            "h11_max_incomplete_event_size": ns.h11_max_incomplete_event_size}


def main(argv: list[str]) -> int:
    """`kvpilot serve` on argv (the arguments after the program name): checks the flags (argparse
    exits 2 on a bad one), then serves until shutdown, or runs a headless node (--node-rank > 0).
    Returns the process's exit code (kvpilot.engine.exit_codes; see the module's docstring)."""
    parser = make_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    if ns.max_queue_len is not None and ns.max_queue_len < 0:
        parser.error(f"--max-queue-len must be >= 0, got {ns.max_queue_len}")
    if ns.drain_timeout < 0:
        parser.error(f"--drain-timeout must be >= 0, got {ns.drain_timeout}")
    if ns.request_deadline_s is not None and ns.request_deadline_s <= 0:
        parser.error(f"--request-deadline-s must be > 0, got {ns.request_deadline_s}")
    check_http_limits(parser, ns)
    check_headless(parser, ns)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        parser.error(f"{BY_NAME['enable_auto_tool_choice'].flag} needs {BY_NAME['tool_call_parser'].flag} "
                     f"(one of {list(BY_NAME['tool_call_parser'].choices)})")
    api_key, admin_token = resolve_secrets(parser, ns)
    try:
        MetricOptions.from_cli_args(ns)  # vLLM's checks of the metric flags
    except ValueError as exc:
        parser.error(str(exc))
    try:
        engine_config = EngineArgs.from_cli_args(ns).create_engine_config()
    except ValueError as exc:
        sys.stderr.write(f"kvpilot serve: error: {exc}\n")
        return report_failure(EXIT_BAD_ARGS, str(exc))
    if engine_config.parallel.node_rank > 0:  # headless with or without --headless (vLLM needs the flag)
        return run_headless(engine_config)
    state = ServerState(
        served_model_name=engine_config.served_model_name, model_path=engine_config.model_path,
        max_model_len=engine_config.scheduler.max_model_len,
        vocab_size=engine_config.model.vocab_size,
        api_key=api_key, admin_token=admin_token,
        max_queue_len=ns.max_queue_len, request_deadline_s=ns.request_deadline_s,
        log_requests=not ns.disable_log_requests,
        profiler_dir=(os.environ.get(PROFILER_DIR_ENV) or None) if admin_token else None,
        show_hidden_metrics_for_version=ns.show_hidden_metrics_for_version,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser, max_logprobs=ns.max_logprobs,
        disable_any_whitespace=json.loads(ns.structured_outputs_config or "{}").get("disable_any_whitespace", False),
    )
    if os.environ.get(PROFILER_DIR_ENV) and not admin_token:
        logger.warning("%s is set but the admin routes are off (--enable-admin-routes): no profiler routes",
                       PROFILER_DIR_ENV)
    if state.profiler_dir:
        logger.info("torch profiler enabled: POST /start_profile and /stop_profile write traces to %s",
                    state.profiler_dir)
    config = uvicorn.Config(build_app(state), host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log, timeout_graceful_shutdown=5,
                            lifespan="off", **http_limits(ns))
    server = DrainingServer(config, state, engine_config, ns)
    try:
        server.run()
    finally:
        if state.engine is not None:
            state.engine.shutdown()
            state.engine.engine.close()  # stops tensor-parallel workers (atexit would too)
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
