"""Per-request sampling parameters, with vLLM's names and meanings (vllm.SamplingParams)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.structured_output.params import StructuredOutputsParams

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it
MAX_TEMPERATURE = 2.0  # vLLM's bound (SamplingParams._verify_args) and OpenAI's
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
        enforced with a token bitmask each step (engine/structured_output/bitmask.py).
    seed: per-request seed; the same seed and prompt give the same output.
    max_tokens: output tokens at most (None: up to max_model_len).
    stop: strings that end the output (not included in the text).
    stop_token_ids: token ids that end the output (kept in the token ids).
    ignore_eos: keep going past the end-of-sequence token.
    logprobs: None for none; N >= 0 returns the chosen token's logprob and the N most
        likely tokens' logprobs at each position (from the model's raw distribution); -1 every
        token's (the server bounds it by --max-logprobs, as vLLM does).
    prompt_logprobs: None for none; N >= 0 (or -1: the whole vocabulary) returns, for every
        prompt position after the first, the prompt token's logprob and rank and the N most
        likely tokens' (the model's raw distribution, computed chunk by chunk during the
        prefill; such a request never reads the prefix cache). The server bounds N by
        --max-logprobs. Source: vLLM `SamplingParams.prompt_logprobs`, `_validate_logprobs`.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token
        already in the output, once (presence) or once per occurrence (frequency), OpenAI's
        definition. repetition_penalty: > 0, 1 is off; the logit of every token in the prompt or
        the output is divided by it where positive and multiplied where negative (CTRL, Keskar
        et al. 2019). Source: vLLM `apply_penalties` (vllm/model_executor/layers/utils.py).
    logit_bias: None, or token id -> bias added to that token's logit before sampling, each in
        [-100, 100] (the server clamps, as vLLM's `SamplingParams.from_optional`).
    bad_words: words the output must not hold; the engine tokenizes each (with and without a
        leading space, vLLM's `update_from_tokenizer`) into `bad_words_token_ids`, and a word's
        last token is forbidden wherever the output ends with the word's other tokens.
    include_stop_str_in_output: keep the stop string that ended the output in its text.
    logits_processors: callables applied in order to this request's logits row before
        sampling (vLLM v0's `logits_processors`); one that raises ends this request only,
        with finish_reason "error".
    Raises ValueError on out-of-range values (seed outside int64, non-finite floats, temperature
    above 2, penalties out of range), naming the parameter first. seed -1 means unseeded and a
    temperature in (0, 0.01) is raised to 0.01, as vLLM's `SamplingParams.__post_init__`.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if 0 < self.temperature < _MIN_TEMPERATURE:  # vLLM: smaller ones overflow to inf/nan
            self.temperature = _MIN_TEMPERATURE
        if self.seed == -1:
            self.seed = None
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number greater than zero, got "
                             f"{self.repetition_penalty}")
        if any(not w for w in self.bad_words):
            raise ValueError("bad_words cannot contain an empty string")
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
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        """True when temperature < GREEDY_EPS (1e-5): the argmax is taken, nothing is drawn."""
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Whether any of the three penalties is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


MAX_NUM_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences after tokenization


def bad_words_token_ids(tokenizer, bad_words: list[str], vocab_size: int) -> list[list[int]]:
    """Each bad word as token ids, as it starts the text and (when that tokenizes to another first
    token of the same length) after a space, vLLM's `SamplingParams.update_from_tokenizer`.
    `tokenizer` is a Hugging Face tokenizer. Raises ValueError naming bad_words for a word that
    tokenizes to nothing, more than MAX_NUM_BAD_WORDS sequences, or ids outside [0, vocab_size)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise ValueError("bad_words entries must tokenize to at least one token")
                continue
            if not prefix or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
                if len(sequences) > MAX_NUM_BAD_WORDS:
                    raise ValueError(f"bad_words: too many bad words after tokenization: {len(sequences)}; "
                                     f"the most is {MAX_NUM_BAD_WORDS}")
    if any(not 0 <= t < vocab_size for ids in sequences for t in ids):
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size})")
    return sequences
