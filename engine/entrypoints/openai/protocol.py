"""Request and response bodies of the OpenAI API (completions, chat completions, models;
errors: errors.py), with vLLM's extra sampling fields (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, allowed_token_ids, truncate_prompt_tokens, skip_special_tokens), structured
outputs and tools (protocol_tools.py). A field kvpilot does not implement is a 400 naming it
(request_fields.py), as is a field no API knows (OpenAI's answer). Types are strict, as
OpenAI's are: `"stream": "yes"` or `"max_tokens": "5"` is a 400, not coerced.

Every number has the bounds the engine can take, stated as JSON Schema minimum/maximum in
/openapi.json and checked before anything reaches the engine (a 400 naming the field):
vLLM's where vLLM has them (`seed` within int64, as vLLM's protocol; `n` >= 1; penalties in
[-2, 2] and repetition_penalty > 0, top_p in (0, 1], temperature in [0, 2], max_tokens >= 1,
min_tokens >= 0, top_k >= -1, min_p in [0, 1], truncate_prompt_tokens >= 1 or -1 (the model's
length), logprobs >= 0 or -1 and at most --max-logprobs, as vLLM's
`SamplingParams._verify_args`; allowed_token_ids non-empty and within the vocabulary, as vLLM's
input processor; logit_bias values clamped to [-100, 100], as vLLM's
`SamplingParams.from_optional`), and int32 for the other counts and token ids (the
dtype of the engine's token tensors). Floats are finite: the JSON extensions NaN and
Infinity, which Python's parser accepts, are a 400.
Source: OpenAI API reference; vLLM `vllm/entrypoints/openai/protocol.py`."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from kvpilot.engine.entrypoints.openai.tool_parsers.protocol import (
    MAX_TOOLS,
    ChatCompletionToolsParam,
    DeltaToolCall,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
    ToolChoice,
)
from kvpilot.engine.entrypoints.openai.protocol_prompt_logprobs import PromptLogprobs
from kvpilot.engine.entrypoints.openai.request_fields import drop_noop_fields, has_lone_surrogate
from kvpilot.engine.settings import BY_NAME, LIVE_SETTINGS, Setting


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.iinfo(torch.long), vLLM's _LONG_INFO
INT32_MAX = 2**31 - 1
MAX_N = 16  # choices per prompt (kvpilot's cap; vLLM only asks n >= 1)
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # kvpilot's cap on the list (larger than any vocabulary it serves)
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS (it counts them after tokenization too)

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_noop_fields(cls, data: Any) -> Any:
        """Unimplemented fields sent with the value that asks for nothing are served; any
        other undeclared field is refused (extra="forbid"; request_fields.py says why)."""
        declared = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return drop_noop_fields(data, declared)

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """Strings must be Unicode text: JSON's "\\ud800" escapes decode to lone surrogates,
        which no tokenizer or UTF-8 response can take."""
        if has_lone_surrogate(value):
            raise ValueError("holds a lone UTF-16 surrogate (such as \\ud800), which is not Unicode text")
        return value


class StreamOptions(_Request):
    """OpenAI's `stream_options` (vLLM's StreamOptions): include_usage adds a last chunk with usage."""
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    n: int | None = Field(1, ge=1, le=MAX_N)  # null: 1 (OpenAI's n is nullable)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None  # None: the tokenizer's (right: keep the first N)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as in JSON) -> bias, clamped to [-100, 100]
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1: the vocabulary; bounded by --max-logprobs
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _null_n_is_one(cls, value: int | None) -> int:
        """OpenAI's and vLLM's n may be null, meaning 1."""
        return 1 if value is None else value

    @field_validator("echo", check_fields=False)
    @classmethod
    def _null_echo_is_false(cls, value: bool | None) -> bool:
        """vLLM takes echo: null as false."""
        return bool(value)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. prompt: text, token ids, or a batch of either."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = False  # null: false, as vLLM
    logprobs: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1: every token's; bounded by --max-logprobs
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True


class ChatMessage(_Request):
    """One message of a chat request (OpenAI's chat message objects, vLLM's
    ChatCompletionMessageParam): role, content (text or content parts), and a tool turn's fields."""
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, given to the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. max_completion_tokens wins over max_tokens."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1: every token's; bounded by --max-logprobs
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none" (OpenAI's default)
    parallel_tool_calls: bool | None = None  # False: at most one call


def _live_field(setting: Setting) -> tuple[Any, Any]:
    kind = Literal[setting.choices] if setting.choices else setting.type  # type: ignore[valid-type]
    low = {"gt" if setting.exclusive_minimum else "ge": setting.minimum} if setting.minimum is not None else {}
    high = {"le": setting.maximum} if setting.maximum is not None else {}
    return kind | None, Field(None, **low, **high)


# POST /admin/scheduler_config: the live-changeable settings of `kvpilot.engine.settings`
# (max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, preemption_mode), each optional.
SchedulerConfigUpdate = create_model(
    "SchedulerConfigUpdate", __config__=ConfigDict(extra="forbid", strict=True),
    __doc__="POST /admin/scheduler_config: the live-changeable scheduler limits.",
    **{name: _live_field(BY_NAME[name]) for name in LIVE_SETTINGS})


# ----------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    """OpenAI's `usage` object (vLLM's UsageInfo): token counts of the prompt and the completion."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions `logprobs` object (vLLM's CompletionLogProbs): per generated
    token its text, character offset, natural-log probability and top alternatives."""
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    """One choice of a completion (vLLM's CompletionResponseChoice); stop_reason (vLLM's extra):
    the stop string or token id that ended it, None at EOS or the length limit."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """The `text_completion` object of POST /v1/completions (OpenAI; vLLM's CompletionResponse)."""
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token in OpenAI's chat logprobs: text, natural-log probability, UTF-8 bytes."""
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """One generated token in OpenAI's chat `logprobs.content` (vLLM's ChatCompletionLogProbsContent)."""
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """A chat choice's `logprobs` object (OpenAI; vLLM's ChatCompletionLogProbs)."""
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """The `message` of a chat choice (OpenAI; vLLM's ChatMessage): text and/or tool calls."""
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    """One choice of a chat completion (vLLM's ChatCompletionResponseChoice); stop_reason as
    CompletionChoice's."""
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """The `chat.completion` object of POST /v1/chat/completions (OpenAI; vLLM's
    ChatCompletionResponse, with its prompt_logprobs)."""
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    """The `delta` of a streamed chat choice (OpenAI; vLLM's DeltaMessage): only what is new."""
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk (vLLM's ChatCompletionResponseStreamChoice)."""
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """The `chat.completion.chunk` object, one SSE event of a streamed chat completion (OpenAI;
    vLLM's ChatCompletionStreamResponse)."""
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """OpenAI's `model` object of GET /v1/models, with vLLM's ModelCard extras: root (the weights'
    path), parent and max_model_len (tokens)."""
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvpilot"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """The `list` object answered by GET /v1/models (OpenAI; vLLM's ModelList)."""
    object: str = "list"
    data: list[ModelCard]
