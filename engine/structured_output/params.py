"""What a request's output must follow: vLLM's `StructuredOutputsParams` (one of a JSON schema,
a regex, a list of choices, an EBNF grammar, or any JSON), checked for shape and size before
anything compiles it. Torch- and xgrammar-free: the server builds it from a request, the
engine's compiler (`backend_xgrammar.py`) turns it into an xgrammar grammar.
Source: vLLM `vllm/sampling_params.py` (`StructuredOutputsParams`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# The largest spec (schema JSON, regex, grammar, or the choices joined) the engine compiles, in
# UTF-8 bytes: a grammar's compile time and memory grow with its text, and a request body of
# megabytes of schema is never a real client's. kvpilot's own limit (vLLM has none).
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_CHOICES = 1024
# The largest repetition count a spec may ask for (a JSON schema's maxLength, minItems..., a regex's or
# grammar's {n,m}): xgrammar's grammar grows with the count (maxLength 10**6 took 2.3 s to compile on a
# 2-core EPYC; 10**9 would never finish), so a short spec could otherwise tie up a compile thread.
MAX_REPETITION = 100_000
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")
_REPEAT = re.compile(r"\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: objects and arrays nested deeper than this in a JSON
# schema are refused before anything walks the schema (grammar conversion cost grows steeply with
# nesting; ~900 levels overflowed Python's recursion in kvpilot's checks before this bound).
MAX_JSON_NESTING = 64
_TOO_DEEP = f"the JSON schema is nested too deeply: objects and arrays may nest at most {MAX_JSON_NESTING} levels"


@dataclass
class StructuredOutputsParams:
    """Exactly one of:
    json: a JSON schema (dict, or its JSON text) the output must be an instance of;
    regex: a regular expression the whole output must match;
    choice: the output is exactly one of these strings;
    grammar: an EBNF (GBNF) grammar with a `root` rule;
    json_object: True: the output is any JSON object or value.
    disable_any_whitespace: JSON without free whitespace between tokens (vLLM's flag; by
        default the grammar allows any whitespace there, as xgrammar's `any_whitespace`).
    `compiled` holds the engine's compiled grammar once the server has compiled it off the
    engine loop (not pickled: other ranks never sample).
    Raises ValueError naming the field when none or several kinds are given, a choice list is
    empty or holds a non-string, a JSON schema is not a JSON object or nests objects and arrays
    deeper than MAX_JSON_NESTING (vLLM's `check_json_nesting`), or the spec is larger
    than MAX_GRAMMAR_BYTES or asks for a repetition count above MAX_REPETITION."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} strings")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except RecursionError:  # deeper than Python's parser goes: far past the bound
                raise ValueError(_TOO_DEEP) from None
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise ValueError("json must be a JSON schema object")
        if self.json is not None and exceeds_json_nesting(parsed if isinstance(self.json, str) else self.json):
            raise ValueError(_TOO_DEEP)
        size = len(self.text().encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the {self.kind} spec is {size} bytes; at most {MAX_GRAMMAR_BYTES} are compiled")
        count = (_largest_count(json.loads(self.text())) if self.kind == "json"
                 else _largest_count(getattr(self, self.kind)) if self.kind in ("regex", "grammar") else 0)
        if count > MAX_REPETITION:
            raise ValueError(f"the {self.kind} asks for a repetition count of {count}; at most {MAX_REPETITION} "
                             f"are compiled")

    @property
    def kind(self) -> str:
        """Which spec was given: the one of KINDS ('json', 'regex', 'choice', ...) that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def text(self) -> str:
        """The spec as one string (the schema as JSON, the choices as a JSON list)."""
        value = getattr(self, self.kind)
        if self.kind in ("regex", "grammar"):
            return value
        if self.kind == "json" and isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "compiled": None}


def _largest_count(value) -> int:
    """The largest repetition count in a spec: JSON-schema count keywords and {n,m} in its
    patterns, or {n,m} in a regex or grammar."""
    if isinstance(value, str):
        return max((int(n or 0) for m in _REPEAT.finditer(value) for n in m.groups() if n), default=0)
    if isinstance(value, list):
        return max((_largest_count(v) for v in value), default=0)
    if isinstance(value, dict):
        own = [v for k, v in value.items() if k in _COUNT_KEYWORDS and isinstance(v, int) and not isinstance(v, bool)]
        nested = [_largest_count(v) for k, v in value.items() if not isinstance(v, str) or k == "pattern"]
        return max([*own, *nested], default=0)
    return 0


def exceeds_json_nesting(value: Any, limit: int = MAX_JSON_NESTING) -> bool:
    """Whether a parsed JSON document nests objects and arrays deeper than `limit`, walked level
    by level (no recursion, so any depth is safe to ask about). Source: vLLM
    `vllm/sampling_params.py` (`_exceeds_json_nesting`)."""
    level = [value]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node) if isinstance(child, (dict, list))]
        if not level:
            return False
    return True
