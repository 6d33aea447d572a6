"""Requests for the liveness fuzz (`kvpilot bench fuzz-liveness`), from the server's own
OpenAPI document:

- schemathesis cases for every operation, positive (valid by the schema) and negative
  (each breaks the schema somewhere), as schemathesis generates them;
- structured cases (issue 40): schemas, regexes, grammars, choices and tools that are deep,
  recursive, huge in their counts, malformed or in conflict, on both generation routes;
- hostile cases (hypothesis): a valid body per POST route with one field, or the first
  message's content, replaced by a value from a hostile family: the field's own stated
  bounds and one past them, huge integers (2**63, 2**70, 10**100), NaN and +-Infinity
  (sent as the JSON extensions Python's parser accepts), wrong types, huge arrays, huge
  strings, odd Unicode (lone surrogates, bidi controls, NUL, combining marks); and raw
  bodies (truncated JSON, arrays nested 100,000 deep).

Valid generation requests are capped at MAX_TOKENS tokens and N choices so the run stays
short; the server's --request-deadline-s bounds the rest."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_TOKENS = 4
MAX_N = 2
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
BASE_BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/admin/scheduler_config": {"max_num_seqs": 4},
}
HUGE_INTS = [2**63, -(2**63) - 1, 2**64, 2**70, -(2**70), 10**100]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0]
WRONG_TYPES = ["5", "", True, None, [], {}, [1], {"a": 1}, 1.5]
ODD_TEXT = ["\ud800", "\udfff\ud800", "\u202e\u2066abc", "\x00\x00", "e\u0301" * 50, "\U0001f600" * 20,
            "\ufeff", "\uffff", "\u200d" * 100]
_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_TOKENS}
_FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}


def _schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


STRUCTURED_BODIES = [  # (route, body): each compiles (or fails) on its own and must never stall the engine
    ("/v1/chat/completions", {**_CHAT, "response_format": _schema(_nested(200))}),
    ("/v1/chat/completions", {**_CHAT, "response_format": _schema(
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"})}),
    ("/v1/chat/completions", {**_CHAT, "response_format": _schema({"type": "string", "maxLength": 10**9})}),
    ("/v1/chat/completions", {**_CHAT, "response_format": _schema({"type": "array", "minItems": 10**7})}),
    ("/v1/chat/completions", {**_CHAT, "response_format": _schema({"type": "nonsense", "enum": []})}),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "json_object"}, "n": 2, "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "structured_outputs": {"regex": "(a+)+$"}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "structured_outputs": {"regex": "a{1,999999999}"}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "structured_outputs": {"regex": "(("}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "structured_outputs": {"grammar": "root ::= root"}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS,
                         "structured_outputs": {"grammar": 'root ::= "a"{1,999999999}'}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "structured_outputs": {"choice": [""]}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "stream": True,
                         "structured_outputs": {"choice": [str(i) for i in range(1000)]}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "min_tokens": MAX_TOKENS,
                         "structured_outputs": {"choice": ["a"]}}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_TOKENS, "allowed_token_ids": [5],
                         "structured_outputs": {"choice": ["a"]}}),
    ("/v1/chat/completions", {**_CHAT, "tools": [_FN] * 128, "tool_choice": "required", "stream": True}),
    ("/v1/chat/completions", {**_CHAT, "tools": [_FN], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "function", "function": {
        "name": "g", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}),
    ("/v1/chat/completions", {**_CHAT, "tools": [_FN]}),  # auto: a 400 without --enable-auto-tool-choice
]
RAW_BODIES = [b'{"prompt": "Hi", "max_tokens": ', b'{"messages": [', b"\xff\xfe", b"null", b"[]", b'"x"',
              b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]


@dataclass(frozen=True)
class FuzzCase:
    """One fuzz request: `method` and `path`, the generator that made it (`kind`), its body (JSON
    `json_body` when has_json, else the `raw` bytes, sent with `content_type`) and query `params`."""

    method: str
    path: str
    kind: str  # "schemathesis-positive", "schemathesis-negative", "hostile-<family>"
    json_body: object = None
    has_json: bool = False
    raw: bytes | None = None
    params: dict = field(default_factory=dict)
    content_type: str | None = None

    def content(self) -> bytes | None:
        """The body bytes: JSON with NaN/Infinity literals allowed, or the raw bytes."""
        if self.has_json:
            return json.dumps(self.json_body, allow_nan=True).encode("utf-8", "surrogatepass")
        return self.raw


def draw(strategy, count: int, seed: int) -> list:
    """`count` examples of a hypothesis strategy, reproducibly for a seed."""
    from hypothesis import HealthCheck, given, seed as hseed, settings

    drawn: list = []

    @hseed(seed)
    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=["generate"])
    @given(strategy)
    def collect(example):
        drawn.append(example)

    collect()
    return drawn[:count]


def capped(body: object, path: str) -> object:
    """A valid generation body with max_tokens <= MAX_TOKENS and n <= MAX_N (set when absent),
    without a `model` (a random name is a 404 before the engine; hostile cases cover it)."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return body
    body = {k: v for k, v in body.items() if k != "model"}
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    body.setdefault("max_tokens", MAX_TOKENS)
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    return body


def schemathesis_cases(openapi: dict, count: int, seed: int) -> list[FuzzCase]:
    """About count/(2 x operations) cases per operation and generation mode."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi)
    operations = [result.ok() for result in schema.get_all_operations()]
    per = -(-count // (2 * len(operations)))
    cases: list[FuzzCase] = []
    for i, op in enumerate(operations):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                drawn = draw(op.as_strategy(generation_mode=mode), per, seed + i)
            except Exception:  # noqa: BLE001 - e.g. nothing negative to generate for a parameterless GET
                continue
            positive = mode is GenerationMode.POSITIVE
            cases += [_from_schemathesis(c, positive) for c in drawn]
    return cases


def _from_schemathesis(case, positive: bool) -> FuzzCase:
    kw = case.as_transport_kwargs(base_url="")
    kind = "schemathesis-" + ("positive" if positive else "negative")
    headers = {k.lower(): v for k, v in (kw.get("headers") or {}).items()}
    common = dict(method=kw["method"], path=case.path, kind=kind, params=dict(kw.get("params") or {}),
                  content_type=headers.get("content-type"))
    if "json" in kw:
        body = capped(kw["json"], case.path) if positive else kw["json"]
        return FuzzCase(**common, json_body=body, has_json=True)
    data = kw.get("data")
    return FuzzCase(**common, raw=data.encode() if isinstance(data, str) else data)


def hostile_strategy(openapi: dict, max_size: int):
    """(path, family, body) with one field of a valid body replaced by a hostile value."""
    from hypothesis import strategies as st

    components = openapi["components"]["schemas"]
    routes = {path: _schema_of(openapi, path, components) for path in BASE_BODIES}
    routes = {path: props for path, props in routes.items() if props}
    sizes = st.sampled_from([s for s in (1_000, 10_000, 100_000, 1_000_000) if s <= max_size])
    families = {
        "huge-int": st.sampled_from(HUGE_INTS),
        "nan-infinity": st.sampled_from(ODD_FLOATS),
        "wrong-type": st.sampled_from(WRONG_TYPES),
        "huge-array": st.builds(lambda n, v: [v] * n, sizes, st.sampled_from([0, 1, "a", [1], 2**40])),
        "huge-string": st.builds(lambda n, c: c * (n // len(c)), sizes, st.sampled_from(["a", "\u00e9", "\U0001f600 "])),
        "odd-unicode": st.sampled_from(ODD_TEXT) | st.text(st.characters(codec=None), min_size=1, max_size=40),
    }

    @st.composite
    def mutated(draw_) -> tuple[str, str, dict]:
        path = draw_(st.sampled_from(sorted(routes)))
        props = routes[path]
        name = draw_(st.sampled_from(sorted(props) + (["messages.0.content"] if "messages" in props else [])))
        bounded = _bounds(props.get(name, {}))
        family = draw_(st.sampled_from(sorted(families) + (["bounds"] if bounded else [])))
        value = draw_(st.sampled_from(bounded) if family == "bounds" else families[family])
        body = json.loads(json.dumps(BASE_BODIES[path]))
        if name == "messages.0.content":
            body["messages"][0]["content"] = value
        else:
            body[name] = value
        return path, family, body

    return mutated()


def hostile_cases(openapi: dict, count: int, seed: int, max_size: int = 1_000_000) -> list[FuzzCase]:
    """`count` hostile requests: the raw bodies and structured-output bodies (each once, on the
    generation routes), the rest drawn with hypothesis (seeded by `seed`) from a valid body per
    POST route of `openapi` with one field replaced by a hostile value (arrays and strings up to
    `max_size`). See the module doc for the families."""
    fixed = len(RAW_BODIES) + len(STRUCTURED_BODIES)
    cases = [FuzzCase("POST", path, "hostile-" + family, json_body=body, has_json=True)
             for path, family, body in draw(hostile_strategy(openapi, max_size), count - fixed, seed)]
    raws = [FuzzCase("POST", path, "hostile-raw", raw=raw, content_type="application/json")
            for path, raw in zip(GENERATION_PATHS * len(RAW_BODIES), RAW_BODIES)]
    structured = [FuzzCase("POST", path, "hostile-structured", json_body=body, has_json=True)
                  for path, body in STRUCTURED_BODIES]
    return cases + raws + structured


def fuzz_cases(openapi: dict, count: int, seed: int = 0, hostile_share: float = 0.4,
               max_size: int = 1_000_000) -> list[FuzzCase]:
    """`count` cases, schemathesis and hostile ones interleaved (hostile ones make up what
    schemathesis does not: it draws each distinct case of a parameterless GET once)."""
    generated = schemathesis_cases(openapi, int(count * (1 - hostile_share)), seed)
    fixed = len(RAW_BODIES) + len(STRUCTURED_BODIES)
    hostile = hostile_cases(openapi, max(fixed + 1, count - len(generated)), seed, max_size)
    merged = [c for pair in zip(generated, hostile) for c in pair]
    merged += generated[len(hostile):] + hostile[len(generated):]
    return merged[:count]


def _schema_of(openapi: dict, path: str, components: dict) -> dict:
    """The properties of a POST route's JSON body schema (the first model of a union)."""
    op = openapi.get("paths", {}).get(path, {}).get("post")
    if op is None:
        return {}
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    schema = (schema.get("anyOf") or [schema])[0]
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return schema.get("properties", {})


def _bounds(prop: dict) -> list:
    """The stated bounds of a numeric field and the values just past them."""
    values = []
    for s in prop.get("anyOf", [prop]):
        if s.get("type") in ("integer", "number"):
            step = 1 if s["type"] == "integer" else 1e-9
            if "minimum" in s:
                values += [s["minimum"], s["minimum"] - step]
            if "exclusiveMinimum" in s:
                values += [s["exclusiveMinimum"]]
            if "maximum" in s:
                values += [s["maximum"], s["maximum"] + step]
    return values
