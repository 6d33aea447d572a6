"""Structured outputs and tools (tests/server/test_server_structured_outputs.py, greedy
here), the structured cases of the liveness fuzz (kvpilot.bench.reliability.fuzz_cases), and
the cases that issue 48 names. Ids: structured/, tools/, issue/."""

from __future__ import annotations

from oracle_cases import CHAT, CMPL, COMPLETION, HI, NEAR_FULL
from oracle_compare import Case

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 12},
    "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    "questions": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["topic", "sentiment", "questions"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
SPECS = {"choice": {"choice": ["alpha", "beta gamma"]}, "regex": {"regex": r"[0-9]{4}-[0-9]{2}"},
         "grammar": {"grammar": 'root ::= ("yes" | "no") "!"'},
         "json": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}}


def schema_format(schema: object) -> dict:
    """A json_schema response_format around `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def nested(depth: int) -> dict:
    """An object schema nested `depth` levels deep."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_body(depth: int) -> bytes:
    """A greedy chat body whose json_schema nests `depth` levels (as bytes: json.dumps recurses)."""
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + '}, "required": ["a"]}' * depth
    return ('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema + '}}}').encode()


def _chat(**fields) -> dict:
    return {"messages": ASK, "max_tokens": 16, "temperature": 0, **fields}


def _structured_cases() -> list[Case]:
    cases = []
    for s in (False, True):
        tag = " stream" * s
        cases += [Case(f"structured/json_schema{tag}", CHAT, _chat(response_format=schema_format(SCHEMA), stream=s,
                                                                    max_tokens=40)),
                  Case(f"tools/required{tag}", CHAT, _chat(tools=[WEATHER, TIME], tool_choice="required", stream=s,
                                                           max_tokens=48)),
                  Case(f"tools/named{tag}", CHAT, _chat(tools=[WEATHER, TIME], stream=s, max_tokens=48,
                                                        tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})),
                  Case(f"tools/auto forced hermes{tag}", CHAT, _chat(tools=[WEATHER, TIME], stream=s, max_tokens=64,
                                                                     structured_outputs={"regex": FORCED})),
                  Case(f"tools/auto forced hermes cut short{tag}", CHAT, _chat(
                      tools=[WEATHER, TIME], stream=s, max_tokens=24, structured_outputs={"regex": FORCED}))]
        cases += [Case(f"structured/{name}{tag}", CMPL, {"prompt": "The answer:", "max_tokens": 16, "temperature": 0,
                                                         "stream": s, "structured_outputs": spec})
                  for name, spec in SPECS.items()]
    cases += [Case("structured/json_object", CHAT, _chat(response_format={"type": "json_object"})),
              Case("tools/auto", CHAT, _chat(tools=[WEATHER, TIME])),
              Case("tools/none", CHAT, _chat(tools=[WEATHER], tool_choice="none"))]
    return cases


REFUSED = [  # test_server_structured_outputs: what cannot be served
    ("unsupported schema type", {"response_format": schema_format({"type": "nonsense"})}),
    ("unbalanced regex", {"structured_outputs": {"regex": "(("}}),
    ("two constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("undefined grammar rule stream", {"structured_outputs": {"grammar": "root ::= x"}, "stream": True}),
    ("named tool not in tools", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "no"}}}),
    ("required without tools", {"tool_choice": "required"}),
    ("129 tools", {"tools": [WEATHER] * 129}),
    ("required tools and json_object", {"tools": [WEATHER], "tool_choice": "required",
                                        "response_format": {"type": "json_object"}}),
]
FUZZ_STRUCTURED = [  # kvpilot.bench.reliability.fuzz_cases.STRUCTURED_BODIES that are safe to send to vLLM
    ("nested 200", CHAT, _chat(max_tokens=4, response_format=schema_format(nested(200)))),
    ("recursive $ref", CHAT, _chat(max_tokens=4, response_format=schema_format(
        {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}))),
    ("nonsense type with empty enum", CHAT, _chat(max_tokens=4, response_format=schema_format(
        {"type": "nonsense", "enum": []}))),
    ("json_object n 2 stream", CHAT, _chat(max_tokens=4, response_format={"type": "json_object"}, n=2, stream=True,
                                           temperature=1.0)),
    ("catastrophic regex", CMPL, {**COMPLETION, "max_tokens": 4, "structured_outputs": {"regex": "(a+)+$"}}),
    ("empty choice", CMPL, {**COMPLETION, "max_tokens": 4, "structured_outputs": {"choice": [""]}}),
    ("1000 choices stream", CMPL, {**COMPLETION, "max_tokens": 4, "stream": True,
                                   "structured_outputs": {"choice": [str(i) for i in range(1000)]}}),
    ("choice with min_tokens", CMPL, {**COMPLETION, "max_tokens": 4, "ignore_eos": True, "min_tokens": 4,
                                      "structured_outputs": {"choice": ["a"]}}),
    ("choice with allowed_token_ids", CMPL, {**COMPLETION, "max_tokens": 4, "allowed_token_ids": [5],
                                             "structured_outputs": {"choice": ["a"]}}),
    ("128 tools required stream", CHAT, _chat(max_tokens=4, tools=[FN] * 128, tool_choice="required", stream=True)),
    ("named f", CHAT, _chat(max_tokens=4, tools=[FN], tool_choice={"type": "function", "function": {"name": "f"}})),
    ("tool with nonsense parameters", CHAT, _chat(max_tokens=4, tool_choice="required", tools=[
        {"type": "function", "function": {"name": "g", "parameters": {"type": "nonsense"}}}])),
]


def _issue_cases() -> list[Case]:
    greedy = {**COMPLETION, "max_tokens": 6}
    bias = [("-100", {"7042": -100}), ("150", {"7042": 150}), ("-1e9", {"7042": -1e9}),
            ("out of vocab 49152", {"49152": 5}), ("out of vocab 10**8", {"100000000": 1})]
    cases = [Case(f"issue/logit_bias {name}", CMPL, {**greedy, "logit_bias": value}) for name, value in bias]
    cases += [Case(f"issue/{name}", CMPL, {**greedy, **fields}) for name, fields in [
        ("temperature 1e308", {"temperature": 1e308}), ("temperature 2.5", {"temperature": 2.5}),
        ("presence_penalty 0.5", {"presence_penalty": 0.5}), ("frequency_penalty 0.5", {"frequency_penalty": 0.5}),
        ("repetition_penalty 1.2", {"repetition_penalty": 1.2}), ("prompt_logprobs 1", {"prompt_logprobs": 1}),
        ("bad_words", {"bad_words": [" Paris"]}), ("include_stop_str_in_output", {"include_stop_str_in_output": True,
                                                                                 "stop": ["."]}),
        ("logprobs -1", {"logprobs": -1}), ("n 2 greedy", {"n": 2}), ("seed -1", {"seed": -1, "temperature": 1.0}),
        ("max_tokens 16 past the context", {"prompt": NEAR_FULL, "max_tokens": 16}),
        ("max_tokens 3000", {"prompt": NEAR_FULL, "max_tokens": 3000}),
        ("truncation_side left", {"truncate_prompt_tokens": 3, "truncation_side": "left", "echo": True}),
        ("truncation_side right", {"truncate_prompt_tokens": 3, "truncation_side": "right", "echo": True}),
        ("top_k 2**64", {"top_k": 2**64, "temperature": 1.0}),
        ("grammar root ::= root", {"structured_outputs": {"grammar": "root ::= root"}}),
    ]]
    cases += [Case(f"issue/stream {name}", CMPL, {**greedy, "stream": True, **fields}) for name, fields in [
        ("presence_penalty 0.5", {"presence_penalty": 0.5}), ("logit_bias 150", {"logit_bias": {"7042": 150}}),
        ("n 2 greedy", {"n": 2}), ("bad_words", {"bad_words": [" Paris"]}),
        ("include_stop_str_in_output", {"include_stop_str_in_output": True, "stop": ["."]}),
    ]]
    cases += [Case(f"issue/logprobs 3 {name}", CMPL, {**greedy, "logprobs": 3, **fields}) for name, fields in [
        ("repetition_penalty 1.3", {"repetition_penalty": 1.3}), ("logit_bias -5", {"logit_bias": {"7042": -5}}),
        ("frequency_penalty 1", {"frequency_penalty": 1.0, "prompt": "one one one one", "max_tokens": 8}),
        ("prompt_logprobs 2", {"prompt_logprobs": 2}), ("echo", {"echo": True}),
    ]]
    chat = {**_chat(max_tokens=6), "messages": HI}
    cases += [Case(f"issue/chat {name}", CHAT, {**chat, **fields}) for name, fields in [
        ("top_logprobs -1", {"logprobs": True, "top_logprobs": -1}), ("n 2 greedy", {"n": 2}),
        ("tools []", {"tools": []}), ("json_schema without schema", {"response_format": {
            "type": "json_schema", "json_schema": {"name": "x"}}}),
        ("nesting 64", {"response_format": schema_format(nested(64))}),
        ("nesting 65", {"response_format": schema_format(nested(65))}),
        ("prompt_logprobs 1", {"prompt_logprobs": 1}),
        ("top_logprobs 2 presence_penalty 1", {"logprobs": True, "top_logprobs": 2, "presence_penalty": 1.0}),
        ("stream logprobs", {"logprobs": True, "stream": True}),
    ]]
    huge = {"response_format": schema_format({"type": "array", "items": {"type": "integer"}, "minItems": 10**9})}
    return cases + [Case("issue/chat nesting 900", CHAT, nested_body(900)),
                    Case("issue/chat minItems 1e9", CHAT, {**chat, **huge}, vllm=False)]


def structured_cases() -> list[Case]:
    """Every case of this module."""
    refused = [Case(f"structured/refused {name}", CHAT, {"messages": ASK, "max_tokens": 4, **body})
               for name, body in REFUSED]
    fuzz = [Case(f"structured/fuzz {name}", path, body) for name, path, body in FUZZ_STRUCTURED]
    return _structured_cases() + refused + fuzz + _issue_cases()
