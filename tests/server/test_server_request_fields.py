"""Nothing accepted that is then ignored (issue 40 item 3): what vLLM refuses is a 400 naming
the field, fields kvpilot does not implement are a 400 unless they ask for nothing, unknown
fields are a 400 in OpenAI's words, and the sampling fields kvpilot accepts (min_p,
allowed_token_ids, truncate_prompt_tokens) change the answer."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def post(server, auth, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", headers=auth, json=body, timeout=60)


@pytest.mark.parametrize("field, value, words", [
    ("min_p", 2.0, "<= 1"), ("min_p", -0.1, ">= 0"),
    ("allowed_token_ids", [], "at least 1"), ("allowed_token_ids", [10**12], "<= 2147483647"),
    ("allowed_token_ids", [49152], "out-of-vocab"),
    ("truncate_prompt_tokens", -5, ">= -1"), ("truncate_prompt_tokens", 0, "must be -1"),
    ("truncate_prompt_tokens", 5000, "must be -1"),
    ("use_beam_search", True, "beam search is not implemented"), ("priority", 3, "first come, first served"),
    ("guided_json", {"type": "object"}, "structured_outputs"), ("logits_processors", ["x.y"], "not loaded"),
    ("frobnicate", 1, "Unrecognized request argument supplied: frobnicate"),
])
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_refused_fields_are_a_400_naming_them(server, auth, path, field, value, words):
    body = {**(COMPLETION if path == "completions" else CHAT), field: value}
    r = post(server, auth, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_fields_that_ask_for_nothing_are_served(server, auth):
    noop = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "logits_processors": None,
            "include_stop_str_in_output": False, "spaces_between_special_tokens": True, "store": False}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "refusal": None, "annotations": None, "audio": None,
                 "function_call": None, "tool_calls": None},
                {"role": "user", "content": "Bye"}]
    assert post(server, auth, "completions", {**COMPLETION, **noop}).status_code == 200
    assert post(server, auth, "chat/completions", {**CHAT, **noop, "messages": messages}).status_code == 200


def test_an_unknown_field_inside_a_message_is_a_400(server, auth):
    r = post(server, auth, "chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi", "mood": 1}]})
    assert r.status_code == 400 and "Unrecognized request argument supplied: mood" in r.json()["error"]["message"]


def test_allowed_token_ids_restrict_every_output_token(server, auth):
    tokens = httpx.post(f"{server.url}/tokenize", headers=auth, json={"prompt": " yes no"}, timeout=30).json()["tokens"]
    r = post(server, auth, "completions", {**COMPLETION, "allowed_token_ids": tokens, "temperature": 1.0, "seed": 3,
                                           "max_tokens": 6, "ignore_eos": True})
    words = r.json()["choices"][0]["text"].split()
    assert len(words) == 6 and set(words) <= {"yes", "no"}, words


def test_min_p_one_gives_the_greedy_answer_at_any_temperature(server, auth):
    greedy = post(server, auth, "completions", COMPLETION).json()["choices"][0]["text"]
    hot = post(server, auth, "completions", {**COMPLETION, "temperature": 2.0, "seed": 9, "min_p": 1.0})
    assert hot.json()["choices"][0]["text"] == greedy


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, auth):
    r = post(server, auth, "completions", {**COMPLETION, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 1})
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"].startswith(" of France is")
