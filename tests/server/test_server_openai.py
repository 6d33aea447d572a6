"""The OpenAI API of `kvpilot serve` through the official `openai` client: completions and
chat, streamed and not, concurrent requests, equality with the offline `LLM` API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import API_KEY, ENGINE_SETTINGS, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
CHAT = [{"role": "user", "content": "Name a fruit."}]


def test_models_lists_the_served_model_with_its_context_length(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024


def test_completion_returns_text_usage_and_length_finish(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 10


def test_streamed_completion_concatenates_to_the_same_text_and_reports_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # tokens arrive one by one, not in one piece
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_and_non_stream_agree(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no usage chunk unless include_usage


def test_raw_stream_is_server_sent_events_ending_with_done(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events[-2] != "data: [DONE]"


def test_concurrent_greedy_requests_equal_the_offline_llm(client):
    from kvpilot.engine import LLM, SamplingParams

    def complete(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)

    def chat():
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        completions = [pool.submit(complete, p) for p in PROMPTS]
        chat_future = pool.submit(chat)
        served = [f.result().choices[0] for f in completions]
        served_chat = chat_future.result().choices[0]
    llm = LLM(**ENGINE_SETTINGS)
    prompts = [llm.get_tokenizer().encode(p, add_special_tokens=False) for p in PROMPTS]
    outputs = llm.generate(prompts + [llm.apply_chat_template(CHAT)], SamplingParams(temperature=0, max_tokens=8))
    *offline, offline_chat = [o.outputs[0] for o in outputs]  # one batch: as in the server, all at once
    assert [c.text for c in served] == [o.text for o in offline]
    assert [c.finish_reason for c in served] == [o.finish_reason for o in offline]
    assert served_chat.message.content == offline_chat.text


def test_stop_string_ends_the_text_before_it_with_finish_reason_stop(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "."


def test_batched_prompts_with_n_give_one_choice_per_prompt_and_sample(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=3, temperature=1.0, seed=11,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=3, temperature=1.0, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # sample j of a prompt: seed + j
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5 + 6  # each prompt counted once


def test_echo_puts_the_prompt_before_the_completion(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + " Paris"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + " Paris"


def test_logprobs_have_one_entry_per_token_with_the_top_alternatives(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and top[chosen] == pytest.approx(logprob)  # greedy: the best
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=1.0, seed=1,
                                        logprobs=0).choices[0].logprobs
    assert [list(top) for top in sampled.top_logprobs] == [[t] for t in sampled.tokens]  # 0: the chosen, as vLLM
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_seeded_sampling_repeats(client):
    a, b = (client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_version_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_profiler_routes_write_a_torch_trace(server, client, auth, admin_auth, profiler_dir):
    assert httpx.post(f"{server.url}/start_profile", headers=auth, timeout=60).status_code == 401  # API key: no
    assert httpx.post(f"{server.url}/start_profile", headers=admin_auth, timeout=60).status_code == 200
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert httpx.post(f"{server.url}/stop_profile", timeout=120).status_code == 401
    assert httpx.post(f"{server.url}/stop_profile", headers=admin_auth, timeout=120).status_code == 200
    traces = wait_until(lambda: list(profiler_dir.glob("*.json")), 30, what="a trace file")
    assert traces[0].stat().st_size > 1000
    assert httpx.post(f"{server.url}/stop_profile", headers=admin_auth).status_code == 409


def test_requests_beyond_max_queue_len_get_503_with_retry_after(server, auth, admin_auth):
    """--max-queue-len 4: with one running slot, a long request runs, four wait, the
    sixth is refused; everyone accepted still completes."""
    admin = f"{server.url}/admin/scheduler_config"
    assert httpx.post(admin, json={"max_num_seqs": 1}, headers=admin_auth).status_code == 200
    try:
        def complete(max_tokens):
            return httpx.post(f"{server.url}/v1/completions", headers=auth, timeout=120,
                              json={"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True})

        with ThreadPoolExecutor(5) as pool:
            long = pool.submit(complete, 40)
            wait_until(lambda: server.metric("vllm:num_requests_running") == 1, 30, what="a running request")
            queued = [pool.submit(complete, 1) for _ in range(4)]
            wait_until(lambda: server.metric("vllm:num_requests_waiting") == 4, 30, what="4 waiting requests")
            refused = complete(1)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "max-queue-len" in refused.json()["error"]["message"]
            assert long.result().status_code == 200 and all(q.result().status_code == 200 for q in queued)
    finally:
        assert httpx.post(admin, json={"max_num_seqs": ENGINE_SETTINGS["max_num_seqs"]},
                          headers=admin_auth).is_success
