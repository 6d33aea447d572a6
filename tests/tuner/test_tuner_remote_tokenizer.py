"""The in-cluster tuner's tokenizer: the engine's own /tokenize and /detokenize over HTTP
(kvpilot.tuner.cluster.remote_tokenizer), against a real `kvpilot serve` of SmolLM2 with an API key.
The ShareGPT load built with it states the prompt lengths the engine counts."""
from __future__ import annotations

import json

import httpx
import pytest

from kvpilot.tuner.local.engine_process import EngineProcess
from kvpilot.tuner.cluster.remote_tokenizer import RemoteTokenizer, RemoteTokenizerError
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.workload import Workload, load_requests

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
KEY = "remote-tokenizer-test-key"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    proc = EngineProcess(MODEL, tmp_path_factory.mktemp("engine") / "engine.log",
                         ["--num-gpu-blocks-override", "64", "--dtype", "float32"], api_key=KEY)
    proc.start(EngineSettings(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512))
    yield proc
    proc.stop()


def prompt_tokens(engine, text: str) -> int:
    r = httpx.post(f"{engine.base_url}/v1/completions", headers=engine.headers, timeout=60,
                   json={"model": MODEL, "prompt": text, "max_tokens": 1})
    return r.json()["usage"]["prompt_tokens"]


def test_sharegpt_load_built_through_the_engine_has_the_engines_token_counts(engine, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # the key from the environment, as in the operator's pod
    tok = RemoteTokenizer(engine.base_url + "/v1", MODEL)
    assert KEY not in repr(tok)
    w = Workload(num_requests=3, warmup_requests=1, max_prompt_len=120, max_output_len=16)
    load = load_requests(tok, w, max_model_len=512)
    assert len(load.requests) == 4
    for r in load.requests[:2]:
        assert 4 <= r.prompt_len <= 120 and 1 <= r.expected_output_len <= 16
        assert r.prompt_len == prompt_tokens(engine, r.prompt)
    ids = tok.encode(load.requests[0].prompt, add_special_tokens=False)
    assert tok.decode(ids[:5]) and len(tok.encode(tok.decode(ids[:5]), add_special_tokens=False)) == 5
    assert tok.vocab_size == 49152  # SmolLM2's vocabulary, found through /detokenize's range check


def test_trace_prompts_are_cut_to_their_token_counts_by_the_engine(engine, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": t, "prompt_len": n, "output_len": 4})
                               for t, n in ((0.0, 7), (0.5, 12))))
    load = load_requests(RemoteTokenizer(engine.base_url, MODEL, api_key=KEY),
                         Workload(dataset=str(trace), num_requests=2, warmup_requests=0), max_model_len=512)
    assert [r.prompt_len for r in load.requests] == [7, 12]
    assert [prompt_tokens(engine, r.prompt) for r in load.requests] == [7, 12]


def test_refusals_name_the_status_without_the_key(engine):
    with pytest.raises(RemoteTokenizerError, match="HTTP 401") as wrong_key:
        RemoteTokenizer(engine.base_url, MODEL, api_key="not-the-key").encode("hello")
    assert "not-the-key" not in str(wrong_key.value)
    with pytest.raises(RemoteTokenizerError, match="HTTP 404.*does not exist"):
        RemoteTokenizer(engine.base_url, "other-model", api_key=KEY).encode("hello")
