"""Tool calls in chat completions, as vLLM serves them: `tool_choice` none, auto (the
`--tool-call-parser` finds calls in the text; needs `--enable-auto-tool-choice`), required
(the output must be a JSON list of calls, one of `tools` each, enforced by the grammar) or a
named function (the output must be its arguments, enforced by the grammar). The answer
carries `tool_calls`, with finish_reason "tool_calls" when the model called tools on its own
or was required to (a named call keeps "stop", as vLLM and OpenAI do); a stream sends them as
`delta.tool_calls` (a named call's arguments as they come; a required or auto call whole
once it is complete).
Source: vLLM `protocol.py` (`check_tool_usage`, `_get_json_schema_from_tool`) and
`serving_chat.py`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import ChatCompletionRequest
from kvpilot.engine.entrypoints.openai.tool_parsers.protocol import FunctionCall, NamedToolChoice, ToolCall
from kvpilot.engine.metrics.tool_parsers import record_tool_parser_invocation
from kvpilot.engine.settings import BY_NAME
from kvpilot.engine.structured_output.params import StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolMode:
    """kind: none, auto, required or named (then `name`); parallel: more than one call allowed."""

    kind: str = "none"
    name: str | None = None
    parallel: bool = True


def tool_mode(req: ChatCompletionRequest, auto_tool_choice: bool) -> ToolMode:
    """The request's tool choice, checked as vLLM checks it (400 naming tool_choice): tools
    without a choice mean auto; a choice other than none needs tools; a named function must be
    one of them; required with no tools means none; auto needs the server's flags."""
    choice, tools = req.tool_choice, req.tools
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolMode("none", parallel=parallel)
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise bad_request("The tool specified in `tool_choice` does not match any of the specified `tools`",
                              param="tool_choice")
        return ToolMode("named", choice.function.name, parallel)
    if choice == "required" and not tools:
        return ToolMode("none", parallel=parallel)
    if choice == "auto" and not auto_tool_choice:
        flags = (BY_NAME["enable_auto_tool_choice"].flag, BY_NAME["tool_call_parser"].flag)
        raise bad_request(f'"auto" tool choice requires {flags[0]} and {flags[1]} to be set on the server; send '
                          f'tool_choice "none", "required" or a named function, or start it with both',
                          param="tool_choice")
    return ToolMode(choice, parallel=parallel)


def tool_spec(req: ChatCompletionRequest, mode: ToolMode, compact: bool = False) -> StructuredOutputsParams | None:
    """The grammar a required or named choice imposes (None for none and auto); compact: JSON
    without free whitespace (the server's disable_any_whitespace)."""
    tools = {t.function.name: t.function for t in req.tools or []}
    if mode.kind == "named":
        return StructuredOutputsParams(json=tools[mode.name].parameters or EMPTY_PARAMETERS,
                                       disable_any_whitespace=compact)
    if mode.kind != "required":
        return None
    defs: dict = {}
    items = []
    for name, function in tools.items():
        parameters = dict(function.parameters or EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise bad_request(f"tools define $defs.{key} twice with different schemas", param="tools")
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                        "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not mode.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)


def final_tool_calls(mode: ToolMode, text: str, parser,
                     streaming: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, tool_calls) of a finished choice. A required choice cut short (max_tokens)
    leaves its text as content and no calls. An auto choice's parser run is counted
    (`vllm:tool_call_parser_invocations_total`; `streaming`: the last step of a stream)."""
    if mode.kind == "named":
        return None, [ToolCall(function=FunctionCall(name=mode.name, arguments=text))]
    if mode.kind == "required":
        try:
            calls = [ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"],
                                                                                         ensure_ascii=False)))
                     for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return text, []
        return None, calls
    if mode.kind == "auto":
        content, calls = parser.extract(text)
        record_tool_parser_invocation(bool(calls), streaming)
        return content, calls if mode.parallel else calls[:1]
    return text, []


def tool_finish_reason(mode: ToolMode, calls: list[ToolCall], finish_reason: str | None) -> str | None:
    """`tool_calls` in place of `stop` when a required or auto choice produced calls (OpenAI's
    finish_reason for them); any other finish_reason, or a named choice's, unchanged."""
    if calls and mode.kind in ("required", "auto") and finish_reason == "stop":
        return "tool_calls"
    return finish_reason
