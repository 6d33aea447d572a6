"""One streamed chat choice with tools: for each step's new text, the content to send and the
`delta.tool_calls`. A named call streams its arguments as they come (the first delta carries
the call's id and name); a required choice sends its calls whole when the output is complete;
auto streams the content up to the parser's first call marker and sends the calls at the end.
Source: vLLM `serving_chat.py` (`chat_completion_stream_generator`)."""

from __future__ import annotations

from kvpilot.engine.entrypoints.openai.tool_parsers.protocol import DeltaFunctionCall, DeltaToolCall, ToolCall
from kvpilot.engine.entrypoints.openai.tool_parsers.calls import ToolMode, final_tool_calls
from kvpilot.engine.metrics.tool_parsers import record_tool_parser_invocation


class ToolStream:
    """The tool-call state of one streamed chat choice: the text so far, how much of it went out as
    content, and the calls sent (the module's docstring gives each tool_choice's way)."""
    def __init__(self, mode: ToolMode, parser) -> None:
        self.mode = mode
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.call_id: str | None = None  # a named call's id, once sent
        self.calls: list[ToolCall] = []  # the calls sent, once the output is complete

    def step(self, new_text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content to send, tool-call deltas to send) for this step."""
        self.text += new_text
        kind = self.mode.kind
        if kind == "none":
            return new_text, []
        if kind == "named":
            return "", self._named(new_text)
        if not finished:
            if kind == "required":
                return "", []
            upto = self.parser.streamable_prefix(self.text)
            record_tool_parser_invocation(False, is_streaming=True)  # vLLM: once per streamed delta
            content, self.sent = self.text[self.sent:upto], max(self.sent, upto)
            return content, []
        content, self.calls = final_tool_calls(self.mode, self.text, self.parser, streaming=True)
        rest = (content or "")[self.sent:] if content is not None and len(content) > self.sent else ""
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(self.calls)]
        return rest, deltas

    def _named(self, new_text: str) -> list[DeltaToolCall]:
        if self.call_id is None:
            call = ToolCall(function={"name": self.mode.name, "arguments": ""})
            self.call_id = call.id
            self.calls = [call]
            return [DeltaToolCall(index=0, id=call.id, type="function",
                                  function=DeltaFunctionCall(name=self.mode.name, arguments=new_text))]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new_text))] if new_text else []
