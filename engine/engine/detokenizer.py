"""Incremental detokenization: turns each new token into the text it adds, without
re-decoding the whole output, and holds text back while a multi-byte character is
incomplete. Decodes a short window twice (with and without the new tokens) so that
tokenizers whose pieces depend on context (leading spaces) stay right.
Source: vLLM `detokenize_incrementally` (prefix_offset / read_offset)."""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's output text, decoded token by token from the last few prompt tokens
    (context for pieces with leading spaces); `text` holds what `add` returned so far."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Appends new token ids; returns the text they complete ('' while a character is
        still partial)."""
        self.tokens.extend(token_ids)
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta
