"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`): they find the calls a
model wrote in its own format in the generated text.

hermes: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text
before the first one is the message content (NousResearch Hermes 2 Pro's format, vLLM's usual
choice for ChatML models such as the builtin SmolLM2, whose chat template has no tool format of
its own). A block that is not valid JSON with a string `name` stays in the content.
Source: vLLM `vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`."""

from __future__ import annotations

import json
import re

from kvpilot.engine.entrypoints.openai.tool_parsers.protocol import FunctionCall, ToolCall


class HermesToolParser:
    """--tool-call-parser hermes: calls in `<tool_call>{"name", "arguments"}</tool_call>` blocks
    (vLLM's Hermes2ProToolParser); an unclosed last block runs to the end of the text."""
    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. content: the text before the first call
        (None when empty); without a parsable call, all of text."""
        calls = []
        for match in self._block.finditer(text):
            call = _call_of(match.group(1) if match.group(1) is not None else match.group(2))
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.start)]
        return content or None, calls

    def streamable_prefix(self, text: str) -> int:
        """How many leading characters of a growing output may be sent as content now: up to
        the first `<tool_call>`, holding back a tail that may be its beginning."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _call_of(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


TOOL_PARSERS = {"hermes": HermesToolParser}  # --tool-call-parser's choices (engine/settings/table.py)
