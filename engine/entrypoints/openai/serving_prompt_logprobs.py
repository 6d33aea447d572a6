"""`prompt_logprobs` in the OpenAI server, as vLLM serves it: which requests ask (the field,
or completions' `echo` with `logprobs`), which are refused (a 400 naming prompt_logprobs:
stream=true with a value > 0 or -1; a value above --max-logprobs), and the JSON the answer
carries: per prompt position None for the first, else {token id: {logprob, rank,
decoded_token}}, the prompt token first then the top N, -inf clamped to -9999.0 (per choice in
completions, top-level in chat); with echo and logprobs, completions' `logprobs` object
covers the prompt tokens too (None for the first).
Sources: vLLM `vllm/entrypoints/openai/completion/protocol.py` and
`chat_completion/protocol.py` (`validate_prompt_logprobs`, `to_sampling_params`),
`vllm/sampling_params.py` (`_validate_logprobs`), `completion/serving.py`
(`request_output_to_completion_response`, `_create_completion_logprobs`),
`vllm/entrypoints/generate/base/serving.py` (`clamp_prompt_logprobs`); the shapes checked
against a live vLLM 0.32 (tests/server/fixtures/vllm_prompt_logprobs.json)."""

from __future__ import annotations

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import _SamplingRequest
from kvpilot.engine.entrypoints.openai.sampling_fields import check_max_logprobs, requested_logprobs
from kvpilot.engine.outputs import Logprob

LOGPROB_FLOOR = -9999.0  # what vLLM answers for -inf (JSON has no infinity)

PromptLogprobs = list[dict[int, Logprob] | None]


def requested_prompt_logprobs(req: _SamplingRequest) -> int | None:
    """The prompt logprobs a request asks for: its `prompt_logprobs`, else with `echo` the
    logprobs it asks for its output (completions' `logprobs`, chat's `top_logprobs`), as vLLM's
    `to_sampling_params`. -1 is the whole vocabulary."""
    value = getattr(req, "prompt_logprobs", None)
    if value is None and getattr(req, "echo", False):
        value = requested_logprobs(req)[1]
    return value


def check_prompt_logprobs(req: _SamplingRequest, vocab_size: int, max_logprobs: int) -> None:
    """400 (param prompt_logprobs) when a streamed request asks for prompt_logprobs > 0 or -1
    (0 streams: vLLM lets it through and sends none), and when the prompt logprobs asked
    (-1: vocab_size) exceed --max-logprobs (-1: vocab_size)."""
    asked = getattr(req, "prompt_logprobs", None)
    if asked is not None and req.stream and (asked > 0 or asked == -1):
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    check_max_logprobs("prompt", requested_prompt_logprobs(req), vocab_size, max_logprobs, "prompt_logprobs")


def decoded_tokens(tokenizer, token_ids: list[int]) -> dict[int, str]:
    """Each id's text decoded alone (vLLM's `convert_ids_list_to_tokens` for a byte-level BPE
    tokenizer: `decode([id])`), in one batch."""
    ids = list(dict.fromkeys(token_ids))
    return dict(zip(ids, tokenizer.batch_decode([[t] for t in ids])))


def _completed_text(tokenizer, token: int, context: list[int]) -> str:
    """The text `token` completes after `context` (up to 4 preceding prompt tokens) when alone it
    decodes to a partial UTF-8 character ("\ufffd"); "" while still incomplete. vLLM's
    `LogprobsProcessor._correct_decoded_token`."""
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = tokenizer.decode([*ctx, token])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)
        while clean_end > 0 and tokenizer.decode([ctx[clean_end - 1]]).endswith("\ufffd"):
            clean_end -= 1
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        return full[common:]
    return ""


def decoded_entries(prompt_logprobs: PromptLogprobs, tokenizer) -> list[dict[int, str] | None]:
    """Per position, each token's decoded_token: decoded alone, and where that ends in a partial
    UTF-8 character, completed with the prompt tokens of the up to 4 positions before (position
    0 has none), as vLLM's `_verify_tokens`."""
    texts = decoded_tokens(tokenizer, [t for entry in prompt_logprobs if entry for t in entry])
    out: list[dict[int, str] | None] = []
    for pos, entry in enumerate(prompt_logprobs):
        if entry is None:
            out.append(None)
            continue
        context = [next(iter(e)) for e in prompt_logprobs[max(0, pos - 4):pos] if e]
        out.append({t: _completed_text(tokenizer, t, context) if texts[t].endswith("\ufffd") else texts[t]
                    for t in entry})
    return out


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None, tokenizer) -> list[dict | None] | None:
    """RequestOutput.prompt_logprobs as the answer's JSON value: {token id: {"logprob",
    "rank", "decoded_token"}} per position (None for the first), -inf as -9999.0."""
    if prompt_logprobs is None:
        return None
    texts = decoded_entries(prompt_logprobs, tokenizer)
    return [None if entry is None else
            {t: {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank, "decoded_token": text[t]}
             for t, lp in entry.items()}
            for entry, text in zip(prompt_logprobs, texts)]


def echo_token_logprobs(prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None, top_n: int,
                        tokenizer) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """The prompt's part of completions' `logprobs` with echo: per prompt token its text, its
    logprob and its alternatives (None, None for the first token), the alternatives being the
    first top_n + 1 entries of the position (the prompt token, then the most likely; vLLM's
    `_create_completion_logprobs`), -inf as -9999.0."""
    prompt_logprobs = prompt_logprobs or [None] * len(prompt_token_ids)
    first = decoded_tokens(tokenizer, prompt_token_ids)  # a position without logprobs: decoded alone
    entries = []
    for token, entry, texts in zip(prompt_token_ids, prompt_logprobs, decoded_entries(prompt_logprobs, tokenizer)):
        if entry is None:
            entries.append((first[token], None, None))
            continue
        top = [(texts[t], max(lp.logprob, LOGPROB_FLOOR)) for t, lp in list(entry.items())[: top_n + 1]]
        entries.append((texts[token], max(entry[token].logprob, LOGPROB_FLOOR), top))
    return entries
