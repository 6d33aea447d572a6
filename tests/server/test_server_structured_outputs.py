"""Structured outputs and tool calls through the official `openai` client against the shared
server (dense weights, small max_tokens): json_schema answers parse and validate for 20
ShareGPT prompts, streamed and not; vLLM's structured_outputs on completions; required, named
and auto tool calls come back as tool_calls whose arguments are valid for the function's
schema; what cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.loadgen.datasets import sample_sharegpt_requests

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 12},
    "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    "questions": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["topic", "sentiment", "questions"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    requests = sample_sharegpt_requests(load_tokenizer("smollm2-135m-instruct"), 200, seed=40)
    return [r.prompt for r in requests if r.prompt_len <= 160][:20]


def _stream_text(client, **kwargs) -> tuple[str, str]:
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_json_schema_answers_validate_for_20_sharegpt_prompts_streamed_and_not(client, prompts):
    assert len(prompts) == 20
    model = client.models.list().data[0].id

    def ask(args):
        prompt, stream = args
        kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64, temperature=0,
                      response_format=RESPONSE_FORMAT)
        if stream:
            return _stream_text(client, **kwargs)
        answer = client.chat.completions.create(**kwargs)
        return answer.choices[0].message.content, answer.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:  # the shared server queues at most 4
        answers = list(pool.map(ask, [(p, s) for p in prompts for s in (False, True)]))
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spec, check", [
    ({"choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
    ({"regex": r"[0-9]{4}-[0-9]{2}"}, lambda t: len(t) == 7 and t[4] == "-" and t.replace("-", "").isdigit()),
    ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!")),
    ({"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, "disable_any_whitespace": True},
     lambda t: isinstance(json.loads(t), list)),
])
def test_structured_outputs_on_completions(client, stream, spec, check):
    kwargs = dict(model=client.models.list().data[0].id, prompt="The answer:", max_tokens=24, temperature=0.8,
                  seed=4, extra_body={"structured_outputs": spec})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert check(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_tool_calls(client, stream):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=80, temperature=0)
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        calls = list(calls.values())
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert finish == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function_with_valid_arguments(client, stream):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                  temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        name, arguments, ids = "", "", set()
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for delta in chunk.choices[0].delta.tool_calls or []:
                name += delta.function.name or ""
                arguments += delta.function.arguments or ""
                ids.add(delta.id) if delta.id else None
        assert len(ids) == 1
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert len(message.tool_calls) == 1 and message.content is None
        name, arguments = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_tool_call_blocks(client, stream):
    """The output is forced (by a regex) into the hermes format, so the parser's path runs
    whatever the small model would write."""
    forced = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                  temperature=0, extra_body={"structured_outputs": {"regex": forced}})
    if stream:
        content, calls, finish = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert "<tool_call" not in content
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMETERS["get_time"])


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Unsupported type"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "root ::= x"}, "stream": True}, "structured_outputs", "not defined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, auth, body, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=auth, timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_auto_tool_choice_without_the_servers_flags_is_a_400_naming_them(limited):
    r = httpx.post(f"{limited.url}/v1/chat/completions", timeout=60, headers={"Authorization": "Bearer test-key-123"},
                   json={"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert "--tool-call-parser" in r.json()["error"]["message"]
