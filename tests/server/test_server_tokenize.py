"""POST /tokenize and /detokenize on the shared server, with vLLM's request and response
shapes (vllm/entrypoints/openai/protocol.py: TokenizeCompletionRequest, TokenizeChatRequest,
TokenizeResponse, DetokenizeRequest, DetokenizeResponse), behind the API key like /v1/*."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TEXT = "The capital of France is"


def post(server, path: str, body: dict, headers: dict | None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers or {}, timeout=60)


def test_tokenize_counts_the_prompt_as_completions_do_and_detokenize_inverts_it(server, auth, client):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": TEXT, "add_special_tokens": False}, auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    usage = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens  # the engine's own count
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}, auth)
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    # the model is optional, as in vLLM; token strings on request
    strs = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}, auth).json()
    assert strs["tokens"][-len(body["tokens"]):] == body["tokens"] and len(strs["token_strs"]) == strs["count"]


def test_tokenize_chat_applies_the_template_with_the_generation_prompt(server, auth):
    messages = [{"role": "user", "content": "Name a fruit."}]
    with_prompt = post(server, "/tokenize", {"model": MODEL, "messages": messages}, auth).json()
    without = post(server, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False},
                   auth).json()
    assert with_prompt["count"] > without["count"] > 4
    text = post(server, "/detokenize", {"model": MODEL, "tokens": with_prompt["tokens"]}, auth).json()["prompt"]
    assert "Name a fruit." in text and text.rstrip().endswith("assistant")


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model_not_found"),
    ("/tokenize", {"model": MODEL}, 400, 400),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, 400),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, 400),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, 400),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, 400),
])
def test_bad_tokenization_requests_get_openai_errors(server, auth, path, body, status, code):
    r = post(server, path, body, auth)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenization_needs_the_api_key(server, path):
    body = {"model": MODEL, "prompt": "hi"} if path == "/tokenize" else {"model": MODEL, "tokens": [1]}
    assert post(server, path, body, None).status_code == 401
    assert post(server, path, body, {"Authorization": "Bearer wrong"}).json()["error"]["code"] == "invalid_api_key"


def test_tokenize_chat_with_special_tokens_is_answered(server, auth):
    """transformers 5's tokenizers have no build_inputs_with_special_tokens: this was a 500
    (found by the liveness fuzz, issue 30). SmolLM2's encode adds no special token."""
    messages = [{"role": "user", "content": "Hi"}]
    plain = post(server, "/tokenize", {"model": MODEL, "messages": messages}, auth).json()
    r = post(server, "/tokenize", {"model": MODEL, "messages": messages, "add_special_tokens": True}, auth)
    assert r.status_code == 200 and r.json()["tokens"] == plain["tokens"]
