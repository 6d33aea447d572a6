"""Request and response shapes of structured outputs and tool calls: OpenAI's `response_format`
(text, json_object, json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object), `tools` and `tool_choice`, and the `tool_calls` of an answer and of its stream
deltas. Bounds: at most MAX_TOOLS tools (OpenAI's limit); function and schema names as OpenAI
spells them (`^[a-zA-Z0-9_-]{1,64}$`).
Source: OpenAI API reference (chat/create); vLLM `vllm/entrypoints/openai/protocol.py`
(`ResponseFormat`, `StructuredOutputsParams`, `ChatCompletionToolsParam`, `ToolCall`)."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # OpenAI's limit on `tools`
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=False)


class JsonSchemaResponseFormat(_Strict):
    """The `json_schema` of OpenAI's response_format (vLLM's JsonSchemaResponseFormat): a name,
    the JSON Schema (sent as `schema`) and the strict flag."""
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`text` asks for nothing; `json_object` for any JSON; `json_schema` for an instance of
    `json_schema.schema` (required, as vLLM 0.33 requires it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice,
    grammar (EBNF with a `root` rule) or json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: the server's (--structured-outputs-config)


class FunctionDefinition(_Strict):
    """OpenAI's function definition of a tool (vLLM's FunctionDefinition): name, description and
    the JSON Schema of its parameters."""
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Strict):
    """One entry of a chat request's `tools` (OpenAI; vLLM's ChatCompletionToolsParam)."""
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    """The `function` of a named tool choice: the name of the tool to call."""
    name: str


class NamedToolChoice(_Strict):
    """A `tool_choice` that forces one tool (OpenAI; vLLM's ChatCompletionNamedToolChoiceParam)."""
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ----------------------------------------------------------------- responses
class FunctionCall(BaseModel):
    """The `function` of an answer's tool call (OpenAI; vLLM's FunctionCall): name and JSON arguments."""
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """One entry of an answer's `tool_calls` (OpenAI; vLLM's ToolCall), id `chatcmpl-tool-<hex>`."""
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    """The part of a function call a stream chunk adds (vLLM's DeltaFunctionCall)."""
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One entry of a stream delta's `tool_calls`, `index` naming the call (OpenAI; vLLM's
    DeltaToolCall)."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
