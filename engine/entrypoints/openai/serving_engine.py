"""`OpenAIServing`: what /v1/completions and /v1/chat/completions share, as one pipeline
with hooks. A request goes down once (model check, engine ready, validation, prompts into
engine requests, admission) and comes back up once (an SSE stream, or the collected final
outputs built into one answer); the subclasses fill in the request-specific hooks.
Source: vLLM `vllm/entrypoints/openai/serving_engine.py` (`OpenAIServing`, `ServeContext`)."""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvpilot.engine.engine.async_engine import AsyncLLMEngine
from kvpilot.engine.entrypoints.errors import APIError, bad_request
from kvpilot.engine.entrypoints.limits import check_request_limits
from kvpilot.engine.entrypoints.openai.sampling_fields import check_sampling_fields, logit_bias_ids, truncate_prompt
from kvpilot.engine.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, UsageInfo, _SamplingRequest
from kvpilot.engine.entrypoints.openai.serving import ServerState, SubRequest, admit, merged_outputs
from kvpilot.engine.entrypoints.openai.serving_prompt_logprobs import check_prompt_logprobs, requested_prompt_logprobs
from kvpilot.engine.entrypoints.openai.serving_stream import collect_finals, sse, streaming_response
from kvpilot.engine.entrypoints.openai.structured_outputs import compile_spec, request_spec
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("kvpilot.server")


@dataclass
class ServeContext:
    """One HTTP request on its way through the pipeline."""

    request: _SamplingRequest
    request_id: str  # "<prefix>-<uuid hex>"; engine request ids add "-<choice index>"
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))  # Unix seconds, as OpenAI's `created`
    subs: list[SubRequest] = field(default_factory=list)
    engine: AsyncLLMEngine | None = None
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives per token
    echo: dict[int, str] = field(default_factory=dict)  # completions' echo=true: prompt text per choice
    text_offsets: dict[int, int] = field(default_factory=dict)  # completions: characters sent per choice
    structured: StructuredOutputsParams | None = None  # the grammar every choice must follow, compiled
    tool_mode: object = None  # chat: tool_calls.ToolMode
    tool_streams: dict[int, object] = field(default_factory=dict)  # chat: tool_stream.ToolStream per choice


class OpenAIServing(ABC):
    """The pipeline; subclasses set `request_id_prefix`, the response classes and the hooks
    `_prepare_sub_requests`, `_stream_choice` and `_final_choice` (and may extend
    `_validate_request` and `_stream_preamble`)."""

    request_id_prefix = ""
    response_class: type[BaseModel]
    stream_response_class: type[BaseModel]

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def handle(self, req: _SamplingRequest, raw: Request) -> Response:
        """Serves one request: JSON, SSE, or an HTTP error (APIError: 400 for bad input, 404
        for an unknown model, 503 while loading, draining or overloaded, 408 past the
        deadline; 499 when the client left)."""
        self._check_model(req.model)
        self.state.ready_engine()  # 503 while loading: the tokenizer comes with the engine
        self._validate_request(req)
        ctx = ServeContext(req, f"{self.request_id_prefix}-{uuid.uuid4().hex}",
                           req.model or self.state.served_model_name)
        spec, param = self._structured_spec(ctx)
        if spec is not None and req.allowed_token_ids is not None:  # their intersection may empty a step's row
            raise bad_request(f"allowed_token_ids cannot be combined with {param}", param="allowed_token_ids")
        if spec is not None:  # compiled on the grammar thread, never on the engine's
            ctx.structured = await compile_spec(self._grammar_compiler, spec, param)
        ctx.subs = self._prepare_sub_requests(ctx)
        ctx.engine = admit(self.state, ctx.subs)
        self._log_request(ctx)
        if req.stream:
            return streaming_response(raw, self.state, ctx.engine, ctx.subs, ctx.request_id,
                                      self._stream_events(ctx))
        finals = await collect_finals(raw, self.state, ctx.engine, ctx.subs)
        if isinstance(finals, Response):
            return finals
        choices = [self._final_choice(ctx, sub.index, finals[sub.index]) for sub in ctx.subs]
        num_out = sum(len(finals[s.index].outputs[0].token_ids) for s in ctx.subs)
        body = self.response_class(id=ctx.request_id, created=ctx.created, model=ctx.model_name, choices=choices,
                                   usage=self._usage(ctx, num_out), **self._answer_fields(ctx, finals))
        return JSONResponse(body.model_dump(), headers={"X-Request-Id": ctx.request_id})

    # ----------------------------------------------------------------- hooks
    def _validate_request(self, req: _SamplingRequest) -> None:
        """400 for what kvpilot does not support and for fields past their limits."""
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        check_request_limits(req)
        vocab = self.state.vocab_size
        if req.allowed_token_ids is not None and vocab and any(t >= vocab for t in req.allowed_token_ids):
            raise bad_request(f"allowed_token_ids contains out-of-vocab token ids; they must be in [0, {vocab})",
                              param="allowed_token_ids")
        check_sampling_fields(req, vocab, self.state.max_logprobs, self.state.max_model_len)
        check_prompt_logprobs(req, vocab, self.state.max_logprobs)
        if req.truncate_prompt_tokens is not None and not (req.truncate_prompt_tokens == -1
                                                           or 1 <= req.truncate_prompt_tokens <= self.state.max_model_len):
            raise bad_request(f"truncate_prompt_tokens must be -1 (the model's length) or in [1, max_model_len "
                              f"{self.state.max_model_len}], got {req.truncate_prompt_tokens}",
                              param="truncate_prompt_tokens")

    def _structured_spec(self, ctx: ServeContext) -> tuple[StructuredOutputsParams | None, str | None]:
        """The grammar the request asks for and the field that asked (response_format,
        structured_outputs; chat adds tool_choice)."""
        return request_spec(ctx.request, self.state.disable_any_whitespace)

    def _grammar_compiler(self):
        return self.state.ready_engine().engine.grammar_compiler

    @abstractmethod
    def _prepare_sub_requests(self, ctx: ServeContext) -> list[SubRequest]:
        """Tokenizes the prompts and returns the engine requests (see `_sub_requests`)."""

    def _answer_fields(self, ctx: ServeContext, finals: dict[int, RequestOutput]) -> dict:
        """The non-streaming answer's fields beyond id, created, model, choices and usage."""
        return {}

    def _stream_preamble(self, ctx: ServeContext) -> Iterator[BaseModel]:
        """Chunks sent before any output."""
        return iter(())

    @abstractmethod
    def _stream_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> BaseModel | None:
        """The choice to send for one step's output of choice `index`; None: nothing yet."""

    @abstractmethod
    def _final_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> BaseModel:
        """The choice `index` (its engine request's final output) of the non-streaming answer."""

    # --------------------------------------------------------------- helpers
    def _check_model(self, model: str | None) -> None:
        names = self.state.model_names()
        if model is not None and model not in names:
            raise APIError(404, f"The model `{model}` does not exist. Served models: {sorted(names)}",
                           param="model", code="model_not_found")

    def _sub_requests(self, ctx: ServeContext, prompts: list[list[int]], max_tokens: int | None,
                      default_max_tokens: int | None) -> list[SubRequest]:
        """n engine requests per prompt: choice p*n + j is sample j of prompt p."""
        n = ctx.request.n
        if ctx.request.truncate_prompt_tokens is not None:
            prompts = [truncate_prompt(ids, ctx.request, self.state.max_model_len) for ids in prompts]
        subs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                params = self._sampling_params(ctx.request, len(ids), max_tokens, default_max_tokens,
                                               ctx.top_logprobs, j, ctx.structured)
                subs.append(SubRequest(p * n + j, f"{ctx.request_id}-{p * n + j}", ids, params, n))
        return subs

    def _sampling_params(self, req: _SamplingRequest, prompt_len: int, max_tokens: int | None,
                         default_max_tokens: int | None, logprobs: int | None, index: int = 0,
                         structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Builds the engine's sampling parameters for one prompt. 400 when max_tokens is not
        positive, when the prompt leaves no room for an output token, or a value is out of range.
        Sample `index` of a seeded request gets seed + index, wrapped into int64 (seed -1: unseeded,
        as vLLM's). max_tokens (or the default) is clamped to what the context leaves."""
        limit = self.state.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt_len} "
                f"tokens; it must be shorter than {limit} to leave room for at least one output token. Please "
                f"reduce the length of the prompt.", param="prompt")
        room = limit - prompt_len  # max_tokens is clamped to it, as vLLM's get_max_tokens
        max_tokens = min(room, max_tokens if max_tokens is not None else default_max_tokens or room)
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k, min_p=req.min_p or 0.0,
                allowed_token_ids=req.allowed_token_ids, structured_outputs=structured,
                seed=None if req.seed in (None, -1) else _wrap_int64(req.seed + index), max_tokens=max_tokens,
                min_tokens=req.min_tokens, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                prompt_logprobs=requested_prompt_logprobs(req),
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, logit_bias=logit_bias_ids(req.logit_bias),
                bad_words=req.bad_words or [], include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as exc:  # SamplingParams names the parameter first
            name = str(exc).split(" ", 1)[0]
            raise bad_request(str(exc), param=name if name in type(req).model_fields else None) from None

    async def _stream_events(self, ctx: ServeContext) -> AsyncIterator[str]:
        """The SSE events of a streaming request, without the final [DONE]."""
        for chunk in self._stream_preamble(ctx):
            yield sse(chunk)
        num_out = 0
        async for index, out in merged_outputs(ctx.engine, ctx.subs):
            if out.finished:
                num_out += len(out.outputs[0].token_ids)
            choice = self._stream_choice(ctx, index, out)
            if choice is not None:
                yield sse(self._chunk(ctx, [choice]))
        if ctx.request.stream_options is not None and ctx.request.stream_options.include_usage:
            yield sse(self._chunk(ctx, [], self._usage(ctx, num_out)))

    def _chunk(self, ctx: ServeContext, choices: list, usage: UsageInfo | None = None) -> BaseModel:
        return self.stream_response_class(id=ctx.request_id, created=ctx.created, model=ctx.model_name,
                                          choices=choices, usage=usage)

    def _usage(self, ctx: ServeContext, num_completion_tokens: int) -> UsageInfo:
        """Each prompt counts once, whatever n is (as OpenAI counts)."""
        num_prompt = sum(len(s.prompt_token_ids) for s in ctx.subs if s.index % s.n == 0)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt + num_completion_tokens)

    def _token_logprobs(self, out: RequestOutput, token_ids: list[int], start: int,
                        top_n: int) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
        """Per output token from position `start`: its text, its logprob, and the top_n most
        likely (text, logprob). The engine's entries hold the chosen token first, then the
        top-N tokens."""
        tokenizer = self.state.tokenizer
        logprobs = out.outputs[0].logprobs
        logprobs = logprobs[start:] if logprobs else None
        entries = []
        for i, tid in enumerate(token_ids):
            entry = logprobs[i] if logprobs is not None and i < len(logprobs) else {}
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            entries.append((tokenizer.decode([tid]), entry.get(tid),
                            [(tokenizer.decode([t]), lp) for t, lp in top]))
        return entries

    def _log_request(self, ctx: ServeContext) -> None:
        if self.state.log_requests:
            subs = ctx.subs
            logger.info("Received request %s: %d prompt(s), prompt tokens %s, params: %s", ctx.request_id,
                        len(subs), [len(s.prompt_token_ids) for s in subs], subs[0].params)


def _wrap_int64(value: int) -> int:
    """value folded into [INT64_MIN, INT64_MAX] (two's complement), so seed + index stays a
    seed torch takes when seed is near the top of the range."""
    return (value - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN
