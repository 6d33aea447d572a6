"""The request fields whose rules need the served model (its vocabulary, its length, the
server's --max-logprobs) and so cannot be a request model's own bounds: n with greedy sampling,
logit_bias, logprobs / top_logprobs, and prompt truncation. Each rule is vLLM 0.33's, and its
400 names the field the request sent.
Sources: vLLM `vllm/sampling_params.py` (`SamplingParams.from_optional`, `_verify_args`,
`_verify_greedy_sampling`, `_validate_logprobs`, `_validate_logit_bias`),
`vllm/renderers/params.py` (`TokenizeParams._truncation_slice`)."""

from __future__ import annotations

from kvpilot.engine.entrypoints.errors import bad_request
from kvpilot.engine.entrypoints.openai.protocol import _SamplingRequest
from kvpilot.engine.sampling_params import GREEDY_EPS

LOGIT_BIAS_BOUND = 100.0  # vLLM clamps each bias into [-100, 100] (OpenAI's range)


def requested_logprobs(req: _SamplingRequest) -> tuple[str, int | None]:
    """The logprobs field this request uses and its value: completions' `logprobs`, chat's
    `top_logprobs` (chat's `logprobs` is a boolean; with it and no top_logprobs: 0)."""
    if isinstance(getattr(req, "logprobs", None), bool):
        return "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None
    return "logprobs", getattr(req, "logprobs", None)


def resolve_logprobs(value: int | None, vocab_size: int) -> int | None:
    """-1 (every token's) as the vocabulary size; other values as given."""
    return vocab_size if value == -1 else value


def check_sampling_fields(req: _SamplingRequest, vocab_size: int, max_logprobs: int, max_model_len: int) -> None:
    """400 naming the field for: max_tokens above max_model_len (vLLM's renderer; below it the
    server clamps max_tokens to what the prompt leaves); n > 1 with greedy sampling; a logit_bias key that is not an
    integer or not a token of the vocabulary; logprobs (or top_logprobs) above --max-logprobs
    (-1: the vocabulary size; a request's -1 asks for the whole vocabulary)."""
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is not None and max_tokens > max_model_len:
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise bad_request(f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please "
                          f"request fewer output tokens.", param=field)
    if req.n > 1 and req.temperature is not None and req.temperature < GREEDY_EPS:
        raise bad_request(f"n must be 1 when using greedy sampling, got {req.n}", param="n")
    logit_bias_ids(req.logit_bias, vocab_size)
    field, value = requested_logprobs(req)
    check_max_logprobs("sample", value, vocab_size, max_logprobs, field)


def check_max_logprobs(kind: str, value: int | None, vocab_size: int, max_logprobs: int, field: str) -> None:
    """400 (param `field`) when `value` logprobs per position (-1: vocab_size) exceed
    --max-logprobs (-1: vocab_size), in vLLM's words ("Requested {kind} logprobs of ...")."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    if value is not None and resolve_logprobs(value, vocab_size) > limit:
        raise bad_request(f"Requested {kind} logprobs of {resolve_logprobs(value, vocab_size)}, which is greater "
                          f"than max allowed: {limit} (the server's --max-logprobs)", param=field)


def logit_bias_ids(logit_bias: dict[str, float] | None, vocab_size: int | None = None) -> dict[int, float] | None:
    """logit_bias with integer token ids and each bias clamped to [-100, 100], as vLLM's
    `SamplingParams.from_optional`. 400 (param logit_bias) for a key that is not an integer,
    and, given vocab_size, for an id outside [0, vocab_size)."""
    if not logit_bias:
        return None
    converted, invalid = {}, []
    for key, bias in logit_bias.items():
        try:
            converted[int(key)] = min(LOGIT_BIAS_BOUND, max(-LOGIT_BIAS_BOUND, bias))
        except ValueError:
            invalid.append(key)
    if invalid:
        raise bad_request(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
                          param="logit_bias")
    outside = [t for t in converted if vocab_size and not 0 <= t < vocab_size]
    if outside:
        raise bad_request(f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                          f"{vocab_size}", param="logit_bias")
    return converted


def truncate_prompt(token_ids: list[int], req: _SamplingRequest, max_model_len: int,
                    default_side: str = "left") -> list[int]:
    """The prompt as truncate_prompt_tokens keeps it: N tokens (-1: max_model_len - 1, room for
    one output token) from the side truncation_side names ('right' cuts the end and keeps the
    first N, 'left' keeps the last N; unset: `default_side`, 'left' as vLLM loads the tokenizer of
    a generating model: vllm/tokenizers/registry.py), as vLLM's `TokenizeParams._truncation_slice`."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep < 0:
        keep = max_model_len - 1
    if keep >= len(token_ids):
        return token_ids
    side = req.truncation_side or default_side
    return token_ids[-keep:] if side == "left" else token_ids[:keep]
