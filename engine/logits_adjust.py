"""The per-request logits processors that change which token wins, batched over a step's rows:
bad words, min_tokens, logit bias, and the presence / frequency / repetition penalties, in
vLLM v1's order (`Sampler.apply_logits_processors`: allowed token ids and the grammar come
first, in the sampler). Each runs as a few tensor operations over the rows that use it, never a
per-token Python loop: the penalties read per-request token counts kept in slots of one
[slots, vocab] tensor (vLLM v1's persistent batch keeps its penalty state the same way) and
updated with one scatter after each step's sampling; logit bias and the token bans of bad words
and min_tokens become one index_put_ each.
Sources: vLLM `vllm/v1/sample/sampler.py`, `vllm/v1/sample/ops/penalties.py` and
`vllm/model_executor/layers/utils.py` (`apply_penalties`), `vllm/v1/sample/ops/bad_words.py`,
`vllm/v1/sample/logits_processor/builtin.py` (`LogitBiasLogitsProcessor`,
`MinTokensLogitsProcessor`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.sampling_params import SamplingParams

_FIRST_SLOTS = 8  # the count tensor's first size in requests; it doubles when full


@dataclass
class _Request:
    params: SamplingParams
    output_token_ids: list[int]  # the live list the scheduler appends to
    stop_token_ids: tuple[int, ...]  # EOS and stop_token_ids: banned while below min_tokens
    bias_ids: torch.Tensor | None  # [k] int64, logit_bias's tokens
    bias_values: torch.Tensor | None  # [k] float32
    prompt_token_ids: list[int]
    slot: int | None = None  # its row of the count tensors (penalized requests only)


class LogitsAdjustments:
    """The state and the batched application of bad_words, min_tokens, logit_bias and the
    penalties. `add` / `forget` a request; per step `apply` (logits [rows, vocab] float32, in
    place) before sampling and `accept` (the sampled tokens) after."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}
        self._counts: torch.Tensor | None = None  # [slots, vocab] float32: output token counts
        self._in_prompt: torch.Tensor | None = None  # [slots, vocab] bool: tokens of the prompt
        self._free: list[int] = []

    def add(self, request_id: str, params: SamplingParams, prompt_token_ids: list[int],
            output_token_ids: list[int], eos_token_ids: tuple[int, ...] = ()) -> None:
        """Registers a request that uses any of the adjustments (others are ignored)."""
        if not (params.bad_words_token_ids or params.min_tokens or params.logit_bias or params.penalized):
            return
        bias_ids = bias_values = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self._requests[request_id] = _Request(
            params, output_token_ids, tuple(dict.fromkeys([*eos_token_ids, *params.stop_token_ids])),
            bias_ids, bias_values, list(prompt_token_ids) if params.repetition_penalty != 1.0 else [])

    def forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and request.slot is not None:
            self._free.append(request.slot)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def active(self, request_ids: list[str]) -> bool:
        """Whether any of a step's rows has an adjustment."""
        return any(r in self._requests for r in request_ids)

    # ------------------------------------------------------------------ a step
    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Applies every row's adjustments to logits [rows, vocab] float32, in place."""
        rows = [(i, self._requests[r]) for i, r in enumerate(request_ids) if r in self._requests]
        if not rows:
            return
        self._ban(logits, rows)
        biased = [(i, q) for i, q in rows if q.bias_ids is not None]
        if biased:
            logits.index_put_(
                (torch.cat([torch.full_like(q.bias_ids, i) for i, q in biased]),
                 torch.cat([q.bias_ids for _, q in biased])),
                torch.cat([q.bias_values for _, q in biased]), accumulate=True)
        penalized = [(i, q) for i, q in rows if q.params.penalized]
        if penalized:
            self._penalize(logits, penalized)

    def accept(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Counts each penalized row's sampled token (one scatter for the step)."""
        slots, tokens = [], []
        for request_id, token in zip(request_ids, token_ids):
            request = self._requests.get(request_id)
            if request is not None and request.slot is not None:
                slots.append(request.slot)
                tokens.append(token)
        if slots:
            self._counts.index_put_((torch.tensor(slots), torch.tensor(tokens)),
                                    torch.ones(len(slots)), accumulate=True)

    # ----------------------------------------------------------------- helpers
    def _ban(self, logits: torch.Tensor, rows: list[tuple[int, _Request]]) -> None:
        """-inf for the stop tokens of rows below min_tokens and for each bad word's last token
        where the output ends with the word's other tokens (vLLM's `apply_bad_words`); where that
        would leave a row no token (its grammar allows only the stop token: a complete `choice`),
        the row's bans are lifted, so the grammar's end wins over min_tokens (vLLM samples a
        token of an all -inf row)."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, q in rows:
            out = q.output_token_ids
            if len(out) < q.params.min_tokens:
                ban_rows += [i] * len(q.stop_token_ids)
                ban_ids += q.stop_token_ids
            for word in q.params.bad_words_token_ids:
                prefix = len(word) - 1
                if prefix <= len(out) and (prefix == 0 or out[-prefix:] == word[:-1]):
                    ban_rows.append(i)
                    ban_ids.append(word[-1])
        if not ban_rows:
            return
        rows_t, ids_t = torch.tensor(ban_rows), torch.tensor(ban_ids)
        kept = logits[rows_t, ids_t].clone()
        logits[rows_t, ids_t] = float("-inf")
        banned = torch.unique(rows_t)
        emptied = banned[torch.isneginf(logits[banned]).all(dim=-1)]
        if len(emptied):  # a ban never empties a row (a grammar that allows only the stop token wins)
            undo = torch.isin(rows_t, emptied)
            logits[rows_t[undo], ids_t[undo]] = kept[undo]

    def _slot(self, request: _Request, vocab_size: int) -> int:
        """The request's row of the count tensors, taken (and filled from its tokens so far) on
        its first penalized step; the tensors double when full."""
        if request.slot is not None:
            return request.slot
        if self._counts is None or self._counts.shape[1] != vocab_size:
            self._counts = torch.zeros(_FIRST_SLOTS, vocab_size)
            self._in_prompt = torch.zeros(_FIRST_SLOTS, vocab_size, dtype=torch.bool)
            self._free = list(range(_FIRST_SLOTS))
            for other in self._requests.values():
                other.slot = None
        if not self._free:
            size = self._counts.shape[0]
            self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
            self._in_prompt = torch.cat([self._in_prompt, torch.zeros_like(self._in_prompt)])
            self._free = list(range(size, 2 * size))
        slot = request.slot = self._free.pop()
        self._counts[slot].zero_()
        self._in_prompt[slot].zero_()
        if request.output_token_ids:
            self._counts[slot].index_add_(0, torch.tensor(request.output_token_ids),
                                          torch.ones(len(request.output_token_ids)))
        if request.prompt_token_ids:
            self._in_prompt[slot, torch.tensor(request.prompt_token_ids)] = True
        return slot

    def _penalize(self, logits: torch.Tensor, rows: list[tuple[int, _Request]]) -> None:
        """vLLM's `apply_penalties` on the penalized rows: repetition (divide positive logits,
        multiply negative ones, for tokens of the prompt or the output), then frequency x count
        and presence x (count > 0) subtracted, OpenAI's definition."""
        vocab = logits.shape[1]
        slots = torch.tensor([self._slot(q, vocab) for _, q in rows])
        index = torch.tensor([i for i, _ in rows])
        counts = self._counts[slots]
        seen = counts > 0
        sub = logits[index]
        repetition = torch.tensor([q.params.repetition_penalty for _, q in rows]).unsqueeze(1)
        if bool((repetition != 1.0).any()):
            hit = seen | self._in_prompt[slots]
            sub = torch.where(hit, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        frequency = torch.tensor([q.params.frequency_penalty for _, q in rows]).unsqueeze(1)
        presence = torch.tensor([q.params.presence_penalty for _, q in rows]).unsqueeze(1)
        sub -= frequency * counts + presence * seen
        logits[index] = sub
