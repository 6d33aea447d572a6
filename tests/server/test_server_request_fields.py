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


@pytest.mark.parametrize("side, kept", [(None, " of France is"), ("right", "The capital of"),
                                        ("left", " of France is")])
def test_truncate_prompt_tokens_keeps_the_side_truncation_side_names(server, auth, side, kept):
    """vLLM 0.33: 'right' cuts the end and keeps the first N, 'left' (the default: vLLM loads a
    generating model's tokenizer with truncation_side left) keeps the last N."""
    extra = {} if side is None else {"truncation_side": side}
    r = post(server, auth, "completions", {**COMPLETION, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 1,
                                           **extra})
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"].startswith(kept)


def text(server, auth, **fields) -> str:
    r = post(server, auth, "completions", {**COMPLETION, "max_tokens": 12, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_penalties_logit_bias_and_bad_words_change_a_greedy_answer(server, auth):
    plain = text(server, auth)
    tokens = httpx.post(f"{server.url}/tokenize", headers=auth, json={"prompt": " Paris"}, timeout=30).json()["tokens"]
    assert plain.startswith(" Paris")
    assert "Paris" not in text(server, auth, bad_words=["Paris"])
    assert not text(server, auth, logit_bias={str(tokens[0]): -100}).startswith(" Paris")
    assert text(server, auth, logit_bias={"34": 1e6}) == text(server, auth, logit_bias={"34": 100})  # clamped
    for penalty in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = text(server, auth, max_tokens=40, **penalty)
        assert penalized != text(server, auth, max_tokens=40), penalty


def test_include_stop_str_in_output_seed_minus_one_and_max_tokens_clamped(server, auth):
    cut = text(server, auth, stop=["."], max_tokens=20)
    kept = text(server, auth, stop=["."], max_tokens=20, include_stop_str_in_output=True)
    assert cut == " Paris" and kept == " Paris."
    r = post(server, auth, "completions", {**COMPLETION, "temperature": 1.0, "seed": -1, "n": 2, "max_tokens": 8})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2  # -1: unseeded, as vLLM
    r = post(server, auth, "completions", {**COMPLETION, "prompt": [42] * 1018, "max_tokens": 50, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1024 - 1018  # clamped to what the context leaves
    r = post(server, auth, "completions", {**COMPLETION, "max_tokens": 1025})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # past max_model_len: vLLM's 400
