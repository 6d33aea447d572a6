"""Bad input gets the right status and an OpenAI-style error body (never FastAPI's raw
422 list), and the server answers the next good request correctly."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import API_KEY

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
LONG_PROMPT = "hello" + " hello" * 1099  # 1100 tokens > max_model_len (1024)

CASES = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ', 400, "not valid JSON"),
    "body is not an object": ("/v1/completions", b'["Hi"]', 400, "invalid request"),
    "max_tokens wrong type": ("/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    "prompt wrong type": ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    "temperature wrong type": ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}, 400,
                               "temperature"),
    "messages not a list": ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    "missing prompt": ("/v1/completions", {"max_tokens": 3}, 400, "missing required field 'prompt'"),
    "missing messages": ("/v1/chat/completions", {"max_tokens": 3}, 400, "missing required field 'messages'"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt must contain at least one token"),
    "max_tokens zero": ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
    "max_tokens negative": ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -5}, 400,
                            "max_tokens must be >= 1, got -5"),
    "prompt too long": ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400,
                        "maximum context length is 1024 tokens. However, your prompt has 1100 tokens"),
    "chat prompt too long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400,
                             "maximum context length is 1024 tokens"),
    "negative temperature": ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature must be >= 0"),
    "top_p out of range": ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "token ids must be in"),
    "image content": ("/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                      400, "only text content"),
    "stream_options without stream": ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}},
                                      400, "stream_options"),
    "penalty out of range": ("/v1/completions", {"prompt": "Hi", "presence_penalty": 2.5}, 400,
                             "presence_penalty must be <= 2"),
    "temperature above 2": ("/v1/completions", {"prompt": "Hi", "temperature": 1e308}, 400, "temperature must be <= 2"),
    "streamed request that is invalid": ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "stream": True}, 400,
                                         "max_tokens"),
    # issue 30: numbers past what the engine takes (2**70 as a seed killed the engine loop)
    "seed beyond int64": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "seed": 2**70},
                          400, "seed must be <= 9223372036854775807, got 1180591620717411303424"),
    "seed below int64": ("/v1/completions", {"prompt": "Hi", "seed": -(2**63) - 1}, 400, "seed must be >= -"),
    "NaN temperature": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                        b'"temperature": NaN}', 400, "temperature must be a finite number"),
    "Infinity top_p": ("/v1/completions", b'{"prompt": "Hi", "top_p": Infinity}', 400, "top_p must be a finite"),
    "huge stop token id": ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**64]}, 400,
                           "stop_token_ids.0 must be <= 2147483647"),
    "huge top_k": ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, 400, "top_k must be <= 2147483647"),
    "huge n": ("/v1/completions", {"prompt": "Hi", "n": 10**30}, 400, "n must be <= 16"),
    "logit_bias key not a token id": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"five": 1}}, 400,
                                      "cannot be converted to integer token IDs"),
    "logit_bias id outside the vocabulary": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"49152": 1}}, 400,
                                             "out-of-vocab"),
    "n > 1 with greedy sampling": ("/v1/completions", {"prompt": "Hi", "n": 2, "temperature": 0}, 400,
                                   "n must be 1 when using greedy sampling"),
    "empty tools": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": []}, 400,
                    "tools must not be an empty array"),
    "lone surrogate in a prompt": ("/v1/completions", b'{"prompt": "Hi \\ud800"}', 400, "lone UTF-16 surrogate"),
    "lone surrogate in a model name": ("/v1/chat/completions", b'{"model": "\\udfff", "messages": '
                                       b'[{"role": "user", "content": "Hi"}]}', 400, "lone UTF-16 surrogate"),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "Hi"}, 404, "The model `gpt-9` does not exist"),
    "unknown route": ("/v1/embeddings", {"input": "Hi"}, 404, "no route POST /v1/embeddings"),
}


def assert_openai_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and "detail" not in response.text
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert fragment in body["error"]["message"], body["error"]["message"]


def good_request_works(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                   json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_an_openai_error_and_the_next_request_works(server, case):
    path, body, status, fragment = CASES[case]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{path}", content=body, headers={**headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)
    assert_openai_error(r, status, fragment)
    good_request_works(server)


def test_wrong_method_gets_405_in_openai_shape(server):
    assert_openai_error(httpx.delete(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}),
                        405, "method DELETE is not allowed")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_missing_or_bad_key_gets_401_before_the_body_is_read(server, headers):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers)
    assert_openai_error(r, 401, "API key")
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert_openai_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401, "API key")
    good_request_works(server)


def test_openai_client_raises_its_typed_errors(server):
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert "maximum context length is 1024" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
