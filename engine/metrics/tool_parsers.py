"""`vllm:tool_call_parser_invocations_total`: how often the `--tool-call-parser` ran, by mode
(streaming: once per streamed step of a choice; non_streaming: once per finished choice),
outcome (tool_call when it found a call) and request type (chat_completions: kvpilot has no
Responses API). Registered, with every label combination at 0, only when a parser is
configured, as vLLM does; recording is a no-op otherwise. Process-wide, as vLLM's: the server's
last `init_parser_metrics` wins.
Source: vLLM `vllm/parser/metrics.py`, `vllm/parser/abstract_parser.py`."""

from __future__ import annotations

from itertools import product

from prometheus_client import CollectorRegistry, Counter

NAME = "vllm:tool_call_parser_invocations_total"
MODES = ("streaming", "non_streaming")
OUTCOMES = ("tool_call", "no_tool_call")
REQUEST_TYPES = ("chat_completions", "responses", "other")

_children: dict[tuple[str, str, str], object] | None = None


def init_parser_metrics(registry: CollectorRegistry | None, model_name: str) -> None:
    """Registers the counter in `registry` with every (mode, outcome, request_type) at 0;
    registry None (no parser configured): recording stops."""
    global _children
    if registry is None:
        _children = None
        return
    counter = Counter(NAME, "Total number of ToolParser invocations. Non-streaming increments once per choice; "
                      "streaming increments once per delta.", ["model_name", "mode", "outcome", "request_type"],
                      registry=registry)
    _children = {(m, o, r): counter.labels(model_name=model_name, mode=m, outcome=o, request_type=r)
                 for m, o, r in product(MODES, OUTCOMES, REQUEST_TYPES)}


def record_tool_parser_invocation(is_tool_called: bool, is_streaming: bool,
                                  request_type: str = "chat_completions") -> None:
    """One parser run; nothing when no parser is configured."""
    if _children is not None:
        mode = "streaming" if is_streaming else "non_streaming"
        _children[(mode, "tool_call" if is_tool_called else "no_tool_call", request_type)].inc()
