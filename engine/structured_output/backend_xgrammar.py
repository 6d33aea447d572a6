"""Compiles a request's `StructuredOutputsParams` into an xgrammar grammar for the engine's
tokenizer, as vLLM's default structured-output backend does. xgrammar caches compiled
grammars (keyed by the spec and its options), so a schema that many requests share compiles
once; compiling releases the GIL, so the server runs it on a worker thread beside the engine
loop (`entrypoints/structured_outputs.py`).

Vocabulary: the bitmask covers the logits' vocabulary (the model's `vocab_size`, which may be
padded past the tokenizer's; the padding ids are never allowed). For the builtin SmolLM2 both
are 49,152. Source: vLLM `vllm/v1/structured_output/backend_xgrammar.py`; xgrammar's
`TokenizerInfo.from_huggingface`, `GrammarCompiler` (https://xgrammar.mlc.ai/docs/)."""

from __future__ import annotations

import json
import re
from typing import Any

from kvpilot.engine.structured_output.params import StructuredOutputsParams

CACHE_LIMIT_BYTES = 256 << 20  # xgrammar's compiled-grammar cache (its default is unbounded)
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (as vLLM's xgrammar backend builds it)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


class GrammarCompiler:
    """One per engine (its tokenizer). `compile` is thread-safe (xgrammar's compiler is)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 1) -> None:
        """vocab_size: the logits' width (model config). Raises ValueError when the tokenizer
        holds more tokens than the logits do."""
        import xgrammar as xgr

        if len(tokenizer) > vocab_size:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's logits only {vocab_size}")
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=CACHE_LIMIT_BYTES)

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokenizer's end-of-sequence ids as xgrammar found them: what a finished grammar allows."""
        return list(self.info.stop_token_ids)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The xgrammar `CompiledGrammar` for params. Raises ValueError with xgrammar's reason
        when the schema, regex or grammar cannot be compiled, or when it allows no first token
        (a grammar such as `root ::= root` matches nothing)."""
        compiled = self._compile(params)
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ValueError(f"the {params.kind} matches no output: no token can start it")
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(params.text(), any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":  # an object, as vLLM's xgrammar backend and OpenAI's JSON mode
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            text = choice_grammar(params.choice) if kind == "choice" else params.grammar
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot compile the {kind}: {xgrammar_message(exc)}") from None

    def cache_size_bytes(self) -> int:
        """Bytes held by xgrammar's compiled-grammar cache (capped at CACHE_LIMIT_BYTES)."""
        return self._compiler.get_cache_size_bytes()


def compiled_grammar(compiler: GrammarCompiler, params: StructuredOutputsParams) -> Any:
    """params' compiled grammar: the one the server attached, else compiled now (offline use,
    on the caller's thread). Raises ValueError as `GrammarCompiler.compile`."""
    if params.compiled is None:
        params.compiled = compiler.compile(params)
    return params.compiled
