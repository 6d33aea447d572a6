"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each,
streaming as SSE or one JSON answer. Source: vLLM `serving_completion.py`."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvpilot.engine.entrypoints.openai.sampling_fields import resolve_logprobs
from kvpilot.engine.entrypoints.openai.serving import ServerState, SubRequest
from kvpilot.engine.entrypoints.openai.serving_engine import OpenAIServing, ServeContext
from kvpilot.engine.entrypoints.openai.serving_prompt_logprobs import echo_token_logprobs, prompt_logprobs_json
from kvpilot.engine.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default, as in vLLM


def completion_prompts(state: ServerState, prompt, add_special_tokens: bool = True) -> list[tuple[list[int], str | None]]:
    """Normalizes `prompt` (text, token ids, or a batch of either) to (token ids, text); text
    is tokenized with the tokenizer's special tokens (BOS) when add_special_tokens (vLLM's
    default for completions)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    vocab = state.vocab_size
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids, text = state.tokenizer.encode(p, add_special_tokens=add_special_tokens), p
        else:
            ids, text = list(p), None
            if any(not 0 <= t < vocab for t in ids):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise bad_request("prompt must contain at least one token", param="prompt")
        out.append((ids, text))
    return out


class OpenAIServingCompletion(OpenAIServing):
    """The POST /v1/completions handler (vLLM's OpenAIServingCompletion): ids `cmpl-<hex>`,
    answers CompletionResponse, streamed as CompletionResponse chunks."""
    request_id_prefix = "cmpl"
    response_class = CompletionResponse
    stream_response_class = CompletionResponse

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        """Serves one completions request (OpenAIServing.handle): JSON, SSE, or an OpenAI error."""
        return await self.handle(req, raw)

    def _validate_request(self, req: CompletionRequest) -> None:
        super()._validate_request(req)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must be unset or equal to n ({req.n})", param="best_of")

    def _prepare_sub_requests(self, ctx: ServeContext) -> list[SubRequest]:
        req = ctx.request
        prompts = completion_prompts(self.state, req.prompt, req.add_special_tokens)
        ctx.top_logprobs = resolve_logprobs(req.logprobs, self.state.vocab_size)
        subs = self._sub_requests(ctx, [ids for ids, _ in prompts], req.max_tokens, DEFAULT_MAX_TOKENS)
        if req.echo:
            whole = req.truncate_prompt_tokens is None  # else the prompt as truncated
            ctx.echo = {s.index: ((whole and prompts[s.index // req.n][1]) or self.state.tokenizer.decode(s.prompt_token_ids))
                        for s in subs}
        ctx.text_offsets = {s.index: len(ctx.echo.get(s.index, "")) for s in subs}
        return subs

    def _stream_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> CompletionChoice | None:
        comp = out.outputs[0]
        prefix = self._echo_logprobs(ctx, out) if index in ctx.echo else []  # the prompt's, with its echo
        text = ctx.echo.pop(index, "") + out.new_text
        lp = None
        if ctx.top_logprobs is not None and out.new_token_ids:
            start = len(comp.token_ids) - len(out.new_token_ids)
            lp = self._logprobs(out, out.new_token_ids, start, ctx.top_logprobs,
                                0 if prefix else ctx.text_offsets[index], prefix)
        ctx.text_offsets[index] += len(out.new_text)
        if not text and lp is None and not out.finished:
            return None  # an incomplete multi-byte character: nothing to send yet
        return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                                stop_reason=comp.stop_reason)

    def _final_choice(self, ctx: ServeContext, index: int, out: RequestOutput) -> CompletionChoice:
        comp = out.outputs[0]
        echo = ctx.echo.get(index, "")
        lp = None
        if ctx.top_logprobs is not None:
            prefix = self._echo_logprobs(ctx, out) if index in ctx.echo else []
            lp = self._logprobs(out, comp.token_ids, 0, ctx.top_logprobs, 0 if prefix else len(echo), prefix)
        return CompletionChoice(index=index, text=echo + comp.text, logprobs=lp, finish_reason=comp.finish_reason,
                                stop_reason=comp.stop_reason,
                                prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs, self.state.tokenizer))

    def _echo_logprobs(self, ctx: ServeContext, out: RequestOutput) -> list:
        """With echo and logprobs, the prompt tokens' entries (vLLM's echo covers them); else []."""
        if ctx.top_logprobs is None:
            return []
        return echo_token_logprobs(out.prompt_token_ids, out.prompt_logprobs, ctx.top_logprobs, self.state.tokenizer)

    def _logprobs(self, out: RequestOutput, token_ids: list[int], start: int, top_n: int,
                  offset: int, prefix: list = ()) -> CompletionLogprobs:
        """`offset`: characters of the choice's text before the first entry; `prefix`: the echoed
        prompt's entries (text, logprob, alternatives or None), before those of `token_ids`."""
        result = CompletionLogprobs()
        entries = [(text, lp, None if top is None else dict(top)) for text, lp, top in prefix]
        entries += [(text, lp, {text: lp, **dict(top)})  # the chosen token, then the top N, as vLLM's
                    for text, lp, top in self._token_logprobs(out, token_ids, start, top_n)]
        for text, lp, top in entries:
            result.tokens.append(text)
            result.token_logprobs.append(lp)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result
