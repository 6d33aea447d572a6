"""prompt_logprobs served as vLLM serves them (issue 48 item 2): every case of
vllm_prompt_logprobs_0.32.json (requests recorded with a live vLLM 0.32 on the same model,
float32) sent to our server gets the same status and error param, and where vLLM answers 200
the same JSON shape: prompt_logprobs per choice in completions and at the top level of chat,
None for the first position, then {token id: {logprob, rank, decoded_token}} with the same
token ids in the same order, the same ranks and decoded tokens and logprobs within 1e-3; with
echo and logprobs, completions' logprobs cover the prompt tokens too (streamed or not). And
--max-logprobs bounds them (the setting, not a constant).

Re-record against a running vLLM: `python tests/server/test_server_prompt_logprobs.py URL`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from kvpilot.engine.entrypoints.errors import APIError
from kvpilot.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.entrypoints.openai.serving_prompt_logprobs import check_prompt_logprobs, requested_prompt_logprobs

FIXTURE = Path(__file__).parent / "vllm_prompt_logprobs_0.32.json"
CASES = json.loads(FIXTURE.read_text())["cases"]
# vLLM completes an output token's partial UTF-8 character from the tokens before it in its
# sample logprobs too; ours decode it alone ("\ufffd"): there only the echoed prompt's entries compare
# (sample logprobs are not this field's; the prompt's entries are)
PROMPT_PART_ONLY = {"completion_utf8_echo_logprobs"}


def send(base_url: str, case: dict, headers: dict | None = None) -> tuple[int, object]:
    """The case's request; (status, JSON answer), a streamed 200 as its list of chunks."""
    r = httpx.post(f"{base_url}/v1/{case['route']}", json=case["request"], headers=headers or {}, timeout=120)
    if case["request"].get("stream") and r.status_code == 200:
        return 200, [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r.status_code, r.json()


def assert_same_prompt_logprobs(ours, theirs) -> None:
    if theirs is None:
        assert ours is None
        return
    assert len(ours) == len(theirs) and ours[0] is None
    for pos, (a, b) in enumerate(zip(ours[1:], theirs[1:]), start=1):
        assert list(a) == list(b), f"position {pos}: token ids (and their order) differ"
        for token, expected in b.items():
            assert set(a[token]) == {"logprob", "rank", "decoded_token"}
            assert (a[token]["rank"], a[token]["decoded_token"]) == (expected["rank"], expected["decoded_token"])
            assert a[token]["logprob"] == pytest.approx(expected["logprob"], abs=1e-3)


def assert_same_completion_logprobs(ours, theirs, count: int | None = None) -> None:
    """The first `count` entries (None: all) of completions' logprobs objects agree."""
    if theirs is None:
        assert ours is None
        return
    if count is not None:
        ours, theirs = ({k: v[:count] for k, v in x.items()} for x in (ours, theirs))
    assert (ours["tokens"], ours["text_offset"]) == (theirs["tokens"], theirs["text_offset"])
    assert [x is None for x in ours["token_logprobs"]] == [x is None for x in theirs["token_logprobs"]]
    assert [x for x in ours["token_logprobs"] if x is not None] == pytest.approx(
        [x for x in theirs["token_logprobs"] if x is not None], abs=1e-3)
    for a, b in zip(ours["top_logprobs"], theirs["top_logprobs"]):
        assert (a is None and b is None) or (list(a) == list(b) and list(a.values()) == pytest.approx(
            list(b.values()), abs=1e-3))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_answer_has_vllm_s_status_param_and_shape(server, auth, name):
    case = CASES[name]
    status, answer = send(server.url, case, auth)
    assert status == case["status"], answer
    expected = case["answer"]
    if status != 200:
        assert answer["error"]["param"] == expected["error"]["param"]
        return
    if isinstance(expected, list):  # streamed: no prompt_logprobs; echo's first chunk covers the prompt
        first, theirs = answer[0]["choices"][0], expected[0]["choices"][0]
        assert first["text"] == theirs["text"]
        assert_same_completion_logprobs(first["logprobs"], theirs["logprobs"])
        assert not any(c["choices"][0].get("prompt_logprobs") for c in answer if c["choices"])
        return
    choice, theirs = answer["choices"][0], expected["choices"][0]
    assert choice.get("message", {}).get("content") == theirs.get("message", {}).get("content")
    if case["route"] == "completions":
        assert "prompt_logprobs" not in answer and "prompt_logprobs" in choice
        assert choice["text"] == theirs["text"]
        assert_same_prompt_logprobs(choice["prompt_logprobs"], theirs["prompt_logprobs"])
        count = len(theirs["prompt_logprobs"]) if name in PROMPT_PART_ONLY else None
        assert_same_completion_logprobs(choice["logprobs"], theirs["logprobs"], count)
    else:
        assert "prompt_logprobs" not in choice and "prompt_logprobs" in answer
        assert_same_prompt_logprobs(answer["prompt_logprobs"], expected["prompt_logprobs"])


@pytest.mark.parametrize("body, max_logprobs, refused", [
    ({"prompt_logprobs": 5}, 5, False), ({"prompt_logprobs": 6}, 5, True),
    ({"prompt_logprobs": -1}, 5, True), ({"prompt_logprobs": -1}, -1, False),
    ({"prompt_logprobs": 96}, -1, False), ({"prompt_logprobs": 97}, -1, True), ({"prompt_logprobs": 0, "stream": True}, 20, False),
    ({"echo": True, "logprobs": 6}, 5, True), ({"echo": True, "logprobs": 5}, 5, False),
])
def test_max_logprobs_bounds_prompt_logprobs_as_vllm(body, max_logprobs, refused):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    if refused:
        with pytest.raises(APIError) as err:
            check_prompt_logprobs(req, 96, max_logprobs)
        assert err.value.param == "prompt_logprobs" and "greater than max allowed" in str(err.value)
    else:
        check_prompt_logprobs(req, 96, max_logprobs)


def test_echo_with_logprobs_asks_for_prompt_logprobs_as_vllm():
    assert requested_prompt_logprobs(CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 3})) == 3
    assert requested_prompt_logprobs(CompletionRequest.model_validate({"prompt": "x", "logprobs": 3})) is None
    assert requested_prompt_logprobs(CompletionRequest.model_validate(
        {"prompt": "x", "echo": True, "logprobs": 3, "prompt_logprobs": 1})) == 1
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1})
    assert requested_prompt_logprobs(chat) == -1


def record(base_url: str) -> None:
    """Sends every case to the vLLM at base_url and writes its answers into the fixture."""
    data = json.loads(FIXTURE.read_text())
    for name, case in data["cases"].items():
        case["status"], case["answer"] = send(base_url, case)
        print(name, case["status"])
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    record(sys.argv[1])
