"""POST /v1/chat/completions: messages through the model's chat template (as the offline
`LLM.chat` does), n choices, streaming deltas as SSE or one JSON answer.
Source: vLLM `serving_chat.py`."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response

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
from kvpilot.engine.entrypoints.serving import ServerState, SubRequest
from kvpilot.engine.entrypoints.serving_engine import OpenAIServing, ServeContext
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


class OpenAIServingChat(OpenAIServing):
    request_id_prefix = "chatcmpl"
    response_class = ChatCompletionResponse
    stream_response_class = ChatCompletionChunk

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        return await self.handle(req, raw)

    def _validate_request(self, req: ChatCompletionRequest) -> None:
        super()._validate_request(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")

    def _prepare_sub_requests(self, ctx: ServeContext) -> list[SubRequest]:
        req = ctx.request
        ids = chat_prompt(self.state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ctx.top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self._sub_requests(ctx, [ids], max_tokens, None)

    def _stream_preamble(self, ctx: ServeContext) -> Iterator[ChatCompletionChunk]:
        for sub in ctx.subs:  # the role first, as OpenAI does
            delta = DeltaMessage(role="assistant", content="")
            yield self._chunk(ctx, [ChatStreamChoice(index=sub.index, delta=delta)])

    def _stream_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> ChatStreamChoice | None:
        comp = out.outputs[0]
        lp = None
        if ctx.top_logprobs is not None and out.new_token_ids:
            start = len(comp.token_ids) - len(out.new_token_ids)
            lp = self._logprobs(out, out.new_token_ids, start, ctx.top_logprobs)
        if not out.new_text and lp is None and not out.finished:
            return None
        delta = DeltaMessage(content=out.new_text) if out.new_text or not out.finished else DeltaMessage()
        return ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=comp.finish_reason,
                                stop_reason=comp.stop_reason)

    def _final_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> ChatChoice:
        comp = out.outputs[0]
        lp = self._logprobs(out, comp.token_ids, 0, ctx.top_logprobs) if ctx.top_logprobs is not None else None
        return ChatChoice(index=index, message=AssistantMessage(content=comp.text),
                          logprobs=lp, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)

    def _logprobs(self, out: RequestOutput, token_ids: list[int], start: int, top_n: int) -> ChatLogprobs:
        content = []
        for text, lp, top in self._token_logprobs(out, token_ids, start, top_n):
            content.append(TokenLogprob(token=text, logprob=lp if lp is not None else float("-inf"),
                                        bytes=list(text.encode()),
                                        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                                      for t, v in top]))
        return ChatLogprobs(content=content)
