"""The grammar constraint inside the engine step: one xgrammar `GrammarMatcher` per request
that has a grammar, and each step one token bitmask over the batch's logits. The masks of all
of a step's structured rows are filled by one batched call (`BatchGrammarMatcher`) and applied
to the logits in place by one call; rows without a grammar are left alone. After sampling,
each structured row's matcher accepts its token.

A matcher that has accepted a stop token is terminated; if the request goes on (ignore_eos,
min_tokens) its rows allow only the stop tokens. Source: vLLM v1 `StructuredOutputManager`
(`grammar_bitmask`) and `apply_grammar_bitmask`; xgrammar's batched matcher API
(https://xgrammar.mlc.ai/docs/api/python/)."""

from __future__ import annotations

from typing import Any

import torch


class GrammarBitmasks:
    """Matchers by request id. vocab_size: the logits' width; stop_token_ids: what a finished
    grammar allows (the tokenizer's end-of-sequence tokens)."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = torch.tensor(stop_token_ids, dtype=torch.long)
        self._matchers: dict[str, Any] = {}
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)  # [rows, ceil(vocab / 32)] int32

    def add(self, request_id: str, compiled_grammar: Any) -> None:
        """Starts a matcher for the request from its xgrammar CompiledGrammar."""
        self._matchers[request_id] = self._xgr.GrammarMatcher(compiled_grammar)

    def forget(self, request_id: str) -> None:
        """Drops the request's matcher (no-op if it had none)."""
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """logits [rows, vocab_size] float32 (CPU or CUDA), row i for request_ids[i]: in place,
        -inf for every token that row's grammar does not allow next."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        live = [i for i in rows if not self._matchers[request_ids[i]].is_terminated()]
        if live:
            if self._bitmask.shape[0] < len(request_ids):
                self._bitmask = self._xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
            bitmask = self._bitmask[: len(request_ids)]
            self._batch.batch_fill_next_token_bitmask([self._matchers[request_ids[i]] for i in live], bitmask, live)
            if logits.device.type != "cpu":  # xgrammar fills on the CPU and applies where the logits are
                bitmask = bitmask.to(logits.device, non_blocking=True)
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=live)
        stop_ids = self.stop_token_ids.to(logits.device)
        for i in set(rows) - set(live):
            stops = logits[i, stop_ids].clone()
            logits[i] = float("-inf")
            logits[i, stop_ids] = stops

    def accept(self, request_ids: list[str], token_ids: list[int]) -> dict[str, BaseException]:
        """Advances each structured request's matcher by its sampled token (one batched
        call). Returns the requests whose token the grammar refused."""
        pairs = [(rid, token) for rid, token in zip(request_ids, token_ids)
                 if rid in self._matchers and not self._matchers[rid].is_terminated()]
        if not pairs:
            return {}
        accepted = self._xgr.BatchGrammarMatcher.batch_accept_token([self._matchers[rid] for rid, _ in pairs],
                                                                     [token for _, token in pairs])
        return {rid: ValueError(f"the grammar refused token {token}")
                for (rid, token), ok in zip(pairs, accepted) if not ok}
