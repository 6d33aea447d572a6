"""Per-request sampling parameters, with vLLM's names and meanings (vllm.SamplingParams)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.structured_output_params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # what torch.Generator.manual_seed takes

# A logits processor (vLLM v0's per-request form): (output_token_ids, logits) -> logits, with
# logits the request's row [vocab_size] float32. It may change the row in place.
LogitsProcessor = Callable[[list[int], "object"], "object"]


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    temperature: 0 means greedy. top_p in (0, 1], top_k -1 (or 0) means off.
    min_p: in [0, 1]; tokens less likely than min_p x the most likely token's probability
        are dropped (after temperature); 0 means off.
    allowed_token_ids: None, or the only token ids the output may hold (non-empty).
    structured_outputs: None, or the grammar the output must follow (json schema, regex,
        choice, EBNF grammar, any JSON); compiled by the engine's xgrammar compiler and
        enforced with a token bitmask each step (engine/grammar_bitmask.py).
    seed: per-request seed; the same seed and prompt give the same output.
    max_tokens: output tokens at most (None: up to max_model_len).
    stop: strings that end the output (not included in the text).
    stop_token_ids: token ids that end the output (kept in the token ids).
    ignore_eos: keep going past the end-of-sequence token.
    logprobs: None for none; N >= 0 returns the chosen token's logprob and the N most
        likely tokens' logprobs at each position (from the model's raw distribution).
    logits_processors: callables applied in order to this request's logits row before
        sampling (vLLM v0's `logits_processors`); one that raises ends this request only,
        with finish_reason "error".
    Raises ValueError on out-of-range values (seed outside int64, non-finite floats),
    naming the parameter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be within int64 [{_INT64_MIN}, {_INT64_MAX}], got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (leave it unset to allow every token)")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
