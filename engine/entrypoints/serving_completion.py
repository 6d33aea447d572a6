"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each,
streaming as SSE or one JSON answer. Source: vLLM `serving_completion.py`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.entrypoints.async_engine import AsyncLLMEngine
from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvpilot.engine.entrypoints.serving import (
    ServerState,
    SubRequest,
    admit,
    check_model,
    log_request,
    merged_outputs,
    reject_unsupported,
    sampling_params,
    sse,
    stream_or_collect,
    token_logprobs,
    usage,
)
from kvpilot.engine.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default, as in vLLM


def completion_prompts(state: ServerState, prompt) -> list[tuple[list[int], str | None]]:
    """Normalizes `prompt` (text, token ids, or a batch of either) to (token ids, text)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    vocab = state.vocab_size
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids, text = state.tokenizer.encode(p, add_special_tokens=False), p
        else:
            ids, text = list(p), None
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise bad_request("prompt must contain at least one token", param="prompt")
        out.append((ids, text))
    return out


def _logprobs(state: ServerState, out: RequestOutput, token_ids: list[int], start: int, top_n: int,
              offset: int) -> CompletionLogprobs:
    lps = out.outputs[0].logprobs
    entries = token_logprobs(state.tokenizer, token_ids, lps[start:] if lps else None, top_n)
    result = CompletionLogprobs()
    for text, lp, top in entries:
        result.tokens.append(text)
        result.token_logprobs.append(lp)
        result.top_logprobs.append(dict(top) if top_n else None)
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    check_model(state, req.model)
    state.ready_engine()  # 503 while loading: the tokenizer comes with the engine
    reject_unsupported(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must be unset or equal to n ({req.n})", param="best_of")
    prompts = completion_prompts(state, req.prompt)
    base = f"cmpl-{uuid.uuid4().hex}"
    subs = []
    for p, (ids, _) in enumerate(prompts):
        for j in range(req.n):
            index = p * req.n + j
            params = sampling_params(state, req, len(ids), req.max_tokens, DEFAULT_MAX_TOKENS, req.logprobs, j)
            subs.append(SubRequest(index, f"{base}-{index}", ids, params, req.n))
    echo = {s.index: (prompts[s.index // req.n][1] or state.tokenizer.decode(s.prompt_token_ids))
            for s in subs} if req.echo else {}
    engine = admit(state, subs)
    log_request(state, base, subs)
    model = req.model or state.served_model_name
    events = (lambda: _stream(state, req, engine, subs, base, model, echo)) if req.stream else None
    finals = await stream_or_collect(raw, state, engine, subs, base, events)
    if isinstance(finals, Response):
        return finals
    choices = []
    for sub in subs:
        out = finals[sub.index]
        comp = out.outputs[0]
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(state, out, comp.token_ids, 0, req.logprobs, len(echo.get(sub.index, "")))
        choices.append(CompletionChoice(index=sub.index, text=echo.get(sub.index, "") + comp.text, logprobs=lp,
                                        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    num_prompt = sum(len(ids) for ids, _ in prompts)  # each prompt once, whatever n is (as OpenAI counts)
    num_out = sum(len(finals[s.index].outputs[0].token_ids) for s in subs)
    body = CompletionResponse(id=base, model=model, choices=choices, usage=usage(num_prompt, num_out))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": base})


async def _stream(state: ServerState, req: CompletionRequest, engine: AsyncLLMEngine, subs: list[SubRequest],
                  base: str, model: str, echo: dict[int, str]) -> AsyncIterator[str]:
    created = int(time.time())
    offsets = {s.index: len(echo.get(s.index, "")) for s in subs}
    num_out = 0
    async for index, out in merged_outputs(engine, subs):
        comp = out.outputs[0]
        text = echo.pop(index, "") + out.new_text
        lp = None
        if req.logprobs is not None and out.new_token_ids:
            start = len(comp.token_ids) - len(out.new_token_ids)
            lp = _logprobs(state, out, out.new_token_ids, start, req.logprobs, offsets[index])
        offsets[index] += len(out.new_text)
        if out.finished:
            num_out += len(comp.token_ids)
        if not text and lp is None and not out.finished:
            continue  # an incomplete multi-byte character: nothing to send yet
        choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                                  stop_reason=comp.stop_reason)
        yield sse(CompletionResponse(id=base, created=created, model=model, choices=[choice]))
    if req.stream_options is not None and req.stream_options.include_usage:
        num_prompt = sum(len(s.prompt_token_ids) for s in subs if s.index % req.n == 0)
        yield sse(CompletionResponse(id=base, created=created, model=model, choices=[],
                                     usage=usage(num_prompt, num_out)))
