"""Request outputs, shaped like vLLM's (`RequestOutput`, `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's logprob at one position (vLLM's `vllm.logprobs.Logprob`): logprob (natural
    log), rank (1 = the most likely token; None where unknown) and decoded_token (None: the
    engine leaves decoding to its caller; the server decodes)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated choice of a request (vLLM's `CompletionOutput`): its text and token ids so
    far, per-token logprobs ({token id: logprob} per position, when asked), finish_reason
    ('stop', 'length', 'abort', 'error'; None while running), stop_reason (the stop token
    id or string that ended it) and cumulative_logprob."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # 'stop', 'length', 'abort', 'error' or None while running
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """Seconds (time.monotonic) at each milestone of a request."""

    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    finished_s: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """What the engine returns for a request after a step (vLLM's `RequestOutput`): the prompt,
    its choices (`outputs`), whether it finished, its timing `metrics`, and what this step
    added (`new_text`, `new_token_ids`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    new_text: str = ""  # text added since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # finish_reason 'error': what failed (the engine went on)
    # SamplingParams.prompt_logprobs set: per prompt position, None for the first, else {token id: Logprob} of
    # the distribution that predicted it, the prompt token first then the top N (vLLM's RequestOutput)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class RequestError(RuntimeError):
    """One request failed in the engine (its setup, its logits processors, detokenizing
    it, its stop handling); it alone ended, and the engine goes on serving the others."""
