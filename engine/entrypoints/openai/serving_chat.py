"""POST /v1/chat/completions: messages through the model's chat template (as the offline
`LLM.chat` does), n choices, streaming deltas as SSE or one JSON answer.
Source: vLLM `serving_chat.py`."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import (
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
from kvpilot.engine.entrypoints.openai.sampling_fields import requested_logprobs, resolve_logprobs
from kvpilot.engine.entrypoints.openai.serving import ServerState, SubRequest
from kvpilot.engine.entrypoints.openai.serving_engine import OpenAIServing, ServeContext
from kvpilot.engine.entrypoints.openai.serving_prompt_logprobs import prompt_logprobs_json
from kvpilot.engine.entrypoints.openai.tool_parsers.calls import final_tool_calls, tool_finish_reason, tool_mode, tool_spec
from kvpilot.engine.entrypoints.openai.tool_parsers.parsers import TOOL_PARSERS
from kvpilot.engine.entrypoints.openai.tool_parsers.stream import ToolStream
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.structured_output.params import StructuredOutputsParams


def _knows_developer_role(chat_template: str | None) -> bool:
    """Whether a chat template renders the developer role itself (vLLM's test: it names it)."""
    return bool(chat_template) and ('"developer"' in chat_template or "'developer'" in chat_template)


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation with the generation prompt. Content may be a string
    or a list of text parts; other parts (images, audio) are refused with 400. Messages' name,
    tool_calls and tool_call_id, and the request's tools, go to the chat template as vLLM
    gives them (the builtin SmolLM2's template renders none of them). OpenAI's `developer` role is
    given as `system` to a template that does not name it (vLLM's `_convert_developer_to_system`,
    vllm/renderers/hf.py)."""
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
        extra = {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                 if v is not None}
        messages.append({"role": m.role, "content": content or "", **extra})
    if not _knows_developer_role(getattr(state.tokenizer, "chat_template", None)):
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if getattr(req, "tools", None) else None
    try:
        out = state.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                                  tokenize=True)
    except Exception as exc:  # jinja errors: bad roles or order for this template
        raise bad_request(f"cannot apply the chat template to these messages: {exc}", param="messages") from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class OpenAIServingChat(OpenAIServing):
    """The POST /v1/chat/completions handler (vLLM's OpenAIServingChat): ids `chatcmpl-<hex>`,
    answers ChatCompletionResponse or a stream of ChatCompletionChunk."""
    request_id_prefix = "chatcmpl"
    response_class = ChatCompletionResponse
    stream_response_class = ChatCompletionChunk

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Serves one chat request (OpenAIServing.handle): JSON, SSE, or an OpenAI error."""
        return await self.handle(req, raw)

    def _validate_request(self, req: ChatCompletionRequest) -> None:
        super()._validate_request(req)
        if req.top_logprobs is not None and req.top_logprobs != 0 and not req.logprobs:
            raise bad_request("when using top_logprobs, logprobs must be set to true", param="top_logprobs")
        if req.tools is not None and not req.tools:
            raise bad_request("tools must not be an empty array; give at least one tool or leave the field out",
                              param="tools")

    def _structured_spec(self, ctx: ServeContext) -> tuple[StructuredOutputsParams | None, str | None]:
        """A required or named tool_choice's grammar, else response_format's or
        structured_outputs' (400 when both are given)."""
        state = self.state
        ctx.tool_mode = tool_mode(ctx.request, state.enable_auto_tool_choice and state.tool_call_parser is not None)
        spec, param = super()._structured_spec(ctx)
        tools_spec = tool_spec(ctx.request, ctx.tool_mode, state.disable_any_whitespace)
        if tools_spec is None:
            return spec, param
        if spec is not None:
            raise bad_request(f"tool_choice {ctx.tool_mode.kind!r} cannot be combined with {param}", param="tool_choice")
        return tools_spec, "tools"

    def _parser(self):
        name = self.state.tool_call_parser
        return TOOL_PARSERS[name]() if name else None

    def _prepare_sub_requests(self, ctx: ServeContext) -> list[SubRequest]:
        req = ctx.request
        ids = chat_prompt(self.state, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ctx.top_logprobs = resolve_logprobs(requested_logprobs(req)[1], self.state.vocab_size)
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
        stream = ctx.tool_streams.setdefault(index, ToolStream(ctx.tool_mode, self._parser()))
        text, calls = stream.step(out.new_text, out.finished)
        if not text and not calls and lp is None and not out.finished:
            return None
        delta = DeltaMessage(content=text if text or not (out.finished or calls) else None, tool_calls=calls or None)
        return ChatStreamChoice(index=index, delta=delta, logprobs=lp, stop_reason=comp.stop_reason,
                                finish_reason=tool_finish_reason(ctx.tool_mode, stream.calls, comp.finish_reason))

    def _final_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> ChatChoice:
        comp = out.outputs[0]
        lp = self._logprobs(out, comp.token_ids, 0, ctx.top_logprobs) if ctx.top_logprobs is not None else None
        content, calls = final_tool_calls(ctx.tool_mode, comp.text, self._parser())
        return ChatChoice(index=index, message=AssistantMessage(content=content, tool_calls=calls),
                          logprobs=lp, finish_reason=tool_finish_reason(ctx.tool_mode, calls, comp.finish_reason),
                          stop_reason=comp.stop_reason)

    def _answer_fields(self, ctx: ServeContext, finals: dict[int, RequestOutput]) -> dict:
        """vLLM's chat answer carries prompt_logprobs at the top level (one prompt for all n)."""
        return {"prompt_logprobs": prompt_logprobs_json(finals[ctx.subs[0].index].prompt_logprobs,
                                                        self.state.tokenizer)}

    def _logprobs(self, out: RequestOutput, token_ids: list[int], start: int, top_n: int) -> ChatLogprobs:
        content = []
        for text, lp, top in self._token_logprobs(out, token_ids, start, top_n):
            content.append(TokenLogprob(token=text, logprob=lp if lp is not None else float("-inf"),
                                        bytes=list(text.encode()),
                                        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                                                      for t, v in top]))
        return ChatLogprobs(content=content)
