"""`kvpilot serve`'s command line, built without importing torch, so that the operator can
parse `spec.engine.extraArgs` with exactly the parser the engine will use.

Flags keep `vllm serve`'s names (full names only: `allow_abbrev=False`, as vLLM's flags are
always written out). The engine settings' flags, defaults and help come from
`kvpilot.engine.settings`; `EngineArgs.add_cli_args` delegates here.
Source: vLLM `vllm/engine/arg_utils.py`, `vllm/entrypoints/openai/cli_args.py`."""

from __future__ import annotations

import argparse
import functools

from kvpilot.engine.settings.setting import Setting
from kvpilot.engine.settings.table import ATTENTION_BACKENDS, ENGINE_SETTINGS, SETTINGS
from kvpilot.engine.settings.env import (
    KVPILOT_ADMIN_TOKEN, VLLM_API_KEY, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, VLLM_TORCH_PROFILER_DIR,
)

__all__ = ["ATTENTION_BACKENDS", "ArgsError", "add_engine_args", "add_http_limit_args", "add_server_args",
           "explicit_dests", "make_serve_parser"]

DEFAULT_MODEL = "smollm2-135m-instruct"

API_KEY_ENV = VLLM_API_KEY  # vLLM reads the key from this variable too
KEEP_ALIVE_ENV = VLLM_HTTP_TIMEOUT_KEEP_ALIVE  # vLLM's only knob for it (seconds, default 5)
ADMIN_TOKEN_ENV = KVPILOT_ADMIN_TOKEN
PROFILER_DIR_ENV = VLLM_TORCH_PROFILER_DIR


class ArgsError(ValueError):
    """Raised instead of exiting by a parser made with `raise_on_error=True`."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's hook; exits by default
        raise ArgsError(message)


def _add_setting(parser: argparse.ArgumentParser, setting: Setting) -> None:
    """One flag of `kvpilot.engine.settings`, as argparse takes it. Only string settings get
    argparse choices; numbers are checked by the engine config (same messages everywhere)."""
    names = [setting.flag] + ([setting.short] if setting.short else [])
    if setting.type is bool:
        parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=setting.default,
                            help=setting.help)
        return
    parser.add_argument(*names, type=setting.parse or setting.type, default=setting.default, help=setting.help,
                        metavar=setting.metavar,
                        choices=list(setting.choices) if setting.choices and setting.type is str else None)


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Adds vLLM's engine flags: every engine setting of `kvpilot.engine.settings`."""
    if positional_model:
        parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="builtin alias, .gguf file or HF directory")
    else:
        parser.add_argument("--model", default=DEFAULT_MODEL, help="builtin alias, .gguf file or HF directory")
    for setting in ENGINE_SETTINGS:
        _add_setting(parser, setting)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags."""
    add = parser.add_argument
    add("--host", default="0.0.0.0", help="address to listen on")
    for setting in SETTINGS:
        if setting.server:
            _add_setting(parser, setting)
    add("--api-key", default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}; prefer the "
             "variable: a flag shows in the process list). An empty key is an error, not 'no auth'")
    add("--enable-admin-routes", action="store_true",
        help=f"serve /admin/scheduler_config (and /start_profile, /stop_profile when ${PROFILER_DIR_ENV} is "
             f"set); they need 'Authorization: Bearer ${ADMIN_TOKEN_ENV}', which must then be set")
    add("--disable-log-stats", action="store_true", help="no periodic throughput/queue/KV-usage log lines "
        "(the /metrics endpoint stays on)")
    add("--disable-log-requests", action="store_true", help="no log line per received request")
    add("--disable-uvicorn-access-log", action="store_true")
    add("--max-queue-len", type=int, default=None,
        help="answer 503 with Retry-After when this many requests are already waiting")
    add("--request-deadline-s", type=float, default=None,
        help="abort a request that has not finished this many seconds after it arrived and tell the client "
             "(408, or an error event in a stream)")
    add("--drain-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds to let accepted requests finish before aborting them")
    add("--log-stats-interval", type=float, default=10.0, help="seconds between stats log lines")
    add_http_limit_args(parser)
    add("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])


def add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    """Limits on slow and idle clients (engine/entrypoints/http_protocol.py): uvicorn's
    and vLLM's names and defaults where they have them."""
    add = parser.add_argument
    add("--request-read-timeout-s", type=float, default=30.0,
        help="close a connection whose request (headers and body) has not arrived in full this many seconds "
             "after its first byte, or that sends nothing this long after opening (408 if part of a request came); "
             "0 turns it off")
    add("--timeout-keep-alive", type=int, default=None,
        help=f"close an idle keep-alive connection after this many seconds (uvicorn's flag; default: ${KEEP_ALIVE_ENV} "
             "as vLLM reads it, else 5)")
    add("--limit-concurrency", type=int, default=None,
        help="answer 503 to new requests once this many connections and tasks are open (uvicorn's flag; "
             "stalled connections count until --request-read-timeout-s closes them)")
    add("--h11-max-incomplete-event-size", type=int, default=4194304,
        help="most bytes of an unfinished request line and headers (vLLM's flag and default)")
    add("--h11-max-header-count", type=int, default=256, help="most headers in one request (vLLM's flag and default)")


def make_serve_parser(raise_on_error: bool = False) -> argparse.ArgumentParser:
    """`kvpilot serve MODEL [flags]`. With raise_on_error, a bad command line raises ArgsError
    (for the operator) instead of printing usage and exiting 2."""
    cls = _RaisingParser if raise_on_error else argparse.ArgumentParser
    parser = cls(prog="kvpilot serve", description="The OpenAI-compatible server, with `vllm serve`'s flags.",
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    add_engine_args(parser, positional_model=True)
    add_server_args(parser)
    return parser


def explicit_dests(argv: list[str]) -> dict[str, object]:
    """The settings argv gives explicitly, by argparse dest (`-tp 3` and
    `--tensor-parallel-size=3` both give {'tensor_parallel_size': 3}), parsed by
    `kvpilot serve`'s own parser. Raises ArgsError for anything that parser refuses
    (unknown or abbreviated flags, stray positionals, bad values)."""
    given = vars(_explicit_parser().parse_args(argv))
    given.pop("help", None)
    return given


@functools.lru_cache(maxsize=1)
def _explicit_parser() -> argparse.ArgumentParser:
    """`kvpilot serve`'s parser with every default suppressed, built once: the operator asks
    explicit_dests on every validation of a resource (0.45 ms a build, several per resource
    and change at 1,000 resources). Parsing leaves the parser unchanged."""
    parser = make_serve_parser(raise_on_error=True)
    for action in parser._actions:  # defaults suppressed: only what argv sets comes back
        action.default = argparse.SUPPRESS
    return parser

