"""POST /v1/chat/completions: messages through the model's chat template (as the offline
`LLM.chat` does), n choices, streaming deltas as SSE or one JSON answer.
Source: vLLM `serving_chat.py`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.entrypoints.async_engine import AsyncLLMEngine
from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
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


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation with the generation prompt. Content may be a string
    or a list of text parts; other parts (images, audio) are refused with 400."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported, got "
                                      f"{part.get('type')!r}", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        messages.append({"role": m.role, "content": content or ""})
    try:
        out = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                  tokenize=True)
    except Exception as exc:  # jinja errors: bad roles or order for this template
        raise bad_request(f"cannot apply the chat template to these messages: {exc}", param="messages") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _logprobs(state: ServerState, out: RequestOutput, token_ids: list[int], start: int, top_n: int) -> ChatLogprobs:
    lps = out.outputs[0].logprobs
    content = []
    for text, lp, top in token_logprobs(state.tokenizer, token_ids, lps[start:] if lps else None, top_n):
        content.append(TokenLogprob(token=text, logprob=lp if lp is not None else float("-inf"),
                                    bytes=list(text.encode()),
                                    top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                                  for t, v in top]))
    return ChatLogprobs(content=content)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    check_model(state, req.model)
    state.ready_engine()  # 503 while loading: the tokenizer comes with the engine
    reject_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    ids = chat_prompt(state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    base = f"chatcmpl-{uuid.uuid4().hex}"
    subs = [SubRequest(j, f"{base}-{j}", ids, sampling_params(state, req, len(ids), max_tokens, None, logprobs, j),
                       req.n) for j in range(req.n)]
    engine = admit(state, subs)
    log_request(state, base, subs)
    model = req.model or state.served_model_name
    events = (lambda: _stream(state, req, engine, subs, base, model, logprobs)) if req.stream else None
    finals = await stream_or_collect(raw, state, engine, subs, base, events)
    if isinstance(finals, Response):
        return finals
    choices = []
    for sub in subs:
        comp = finals[sub.index].outputs[0]
        lp = _logprobs(state, finals[sub.index], comp.token_ids, 0, logprobs) if logprobs is not None else None
        choices.append(ChatChoice(index=sub.index, message=AssistantMessage(content=comp.text), logprobs=lp,
                                  finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    num_out = sum(len(finals[s.index].outputs[0].token_ids) for s in subs)
    body = ChatCompletionResponse(id=base, model=model, choices=choices, usage=usage(len(ids), num_out))
    return JSONResponse(body.model_dump(), headers={"X-Request-Id": base})


async def _stream(state: ServerState, req: ChatCompletionRequest, engine: AsyncLLMEngine, subs: list[SubRequest],
                  base: str, model: str, logprobs: int | None) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=base, created=created, model=model, choices=[choice]))

    for sub in subs:  # the role first, as OpenAI does
        yield chunk(ChatStreamChoice(index=sub.index, delta=DeltaMessage(role="assistant", content="")))
    num_out = 0
    async for index, out in merged_outputs(engine, subs):
        comp = out.outputs[0]
        lp = None
        if logprobs is not None and out.new_token_ids:
            lp = _logprobs(state, out, out.new_token_ids, len(comp.token_ids) - len(out.new_token_ids), logprobs)
        if out.finished:
            num_out += len(comp.token_ids)
        if not out.new_text and lp is None and not out.finished:
            continue
        delta = DeltaMessage(content=out.new_text) if out.new_text or not out.finished else DeltaMessage()
        yield chunk(ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=comp.finish_reason,
                                     stop_reason=comp.stop_reason))
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse(ChatCompletionChunk(id=base, created=created, model=model, choices=[],
                                      usage=usage(len(subs[0].prompt_token_ids), num_out)))
