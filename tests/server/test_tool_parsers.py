"""The hermes tool-call parser and the stream of a choice with tools (no server): calls found
in the text with their JSON arguments, content before them, nothing of a call leaked into a
streamed content delta even when its marker arrives split over steps."""

from __future__ import annotations

import json

from kvpilot.engine.entrypoints.openai.tool_parsers.calls import ToolMode, final_tool_calls
from kvpilot.engine.entrypoints.openai.tool_parsers.parsers import HermesToolParser
from kvpilot.engine.entrypoints.openai.tool_parsers.stream import ToolStream

TEXT = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')


def test_hermes_finds_every_call_and_the_content_before_them():
    content, calls = HermesToolParser().extract(TEXT)
    assert content == "Let me check. "  # as written, as vLLM's hermes parser keeps it
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2


def test_hermes_leaves_text_without_a_parsable_call_as_content():
    parser = HermesToolParser()
    assert parser.extract("no calls here") == ("no calls here", [])
    broken = 'x <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parser.extract(broken) == (broken, [])


def test_the_auto_stream_never_sends_a_call_marker_as_content():
    stream = ToolStream(ToolMode("auto"), HermesToolParser())
    pieces = [TEXT[i:i + 3] for i in range(0, len(TEXT), 3)]
    sent, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = stream.step(piece, i == len(pieces) - 1)
        sent += text
        deltas += calls
    assert sent.strip() == "Let me check." and "<" not in sent
    assert [d.function.name for d in deltas] == ["get_weather", "get_time"] and [d.index for d in deltas] == [0, 1]


def test_a_named_stream_sends_its_arguments_as_they_come_under_one_id():
    stream = ToolStream(ToolMode("named", "f"), None)
    deltas = [d for piece in ('{"x"', ": 1", "}") for d in stream.step(piece, False)[1]]
    assert deltas[0].id and deltas[0].function.name == "f" and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == '{"x": 1}'


def test_a_required_choice_cut_short_keeps_its_text_as_content():
    assert final_tool_calls(ToolMode("required"), '[{"name": "f", "parame', None) == ('[{"name": "f", "parame', [])
    content, calls = final_tool_calls(ToolMode("required"), '[{"name": "f", "parameters": {"x": 1}}]', None)
    assert content is None and calls[0].function.name == "f" and json.loads(calls[0].function.arguments) == {"x": 1}
