"""Workload loading without a server: ShareGPT fitted to the length limits with warm-up
requests in front, and a replayed trace with its arrival offsets and lengths."""
from __future__ import annotations

import json

import pytest

from kvpilot.loadgen.metrics import RequestResult
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.measure.workload import Workload, client_measurement, load_requests


class WordTokenizer:
    """One token per word (enough for the dataset code: encode and decode)."""

    def encode(self, text, add_special_tokens=True):
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def sharegpt(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": " ".join(["q"] * (5 + 7 * i))},
                                              {"from": "gpt", "value": " ".join(["a"] * (4 + 3 * i))}]}
             for i in range(40)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_requests_fit_the_caps_and_start_with_warmups(sharegpt):
    w = Workload(num_requests=6, max_prompt_len=100, max_output_len=20, warmup_requests=2)
    load = load_requests(WordTokenizer(), w, max_model_len=110, sharegpt_path=str(sharegpt))
    assert len(load.requests) == 8 and load.offsets is None
    assert all(r.prompt_len <= 100 and r.expected_output_len <= 20 for r in load.requests)
    assert all(r.prompt_len + r.expected_output_len <= 110 for r in load.requests)
    with pytest.raises(ValueError, match="fit max_model_len"):
        load_requests(WordTokenizer(), Workload(num_requests=30, max_prompt_len=20), 100, str(sharegpt))


def test_trace_replay_keeps_arrival_offsets_and_lengths(sharegpt, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100.0 + t, "prompt_len": 30, "output_len": 12} for t in (0.0, 0.5, 2.0)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    load = load_requests(WordTokenizer(), Workload(dataset=str(trace), num_requests=3, warmup_requests=1),
                         max_model_len=512, sharegpt_path=str(sharegpt))
    assert load.offsets == [0.0, 0.0, 0.5, 2.0]  # the warm-up first, then the trace's offsets
    assert [r.expected_output_len for r in load.requests[1:]] == [12, 12, 12]
    assert all(r.prompt_len <= 30 for r in load.requests)


def test_client_goodput_counts_requests_meeting_every_slo():
    ok = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.5, itl=[0.05] * 10, latency=1.0)
    slow = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=3.0, itl=[0.05] * 10, latency=3.5)
    failed = RequestResult(success=False, error="boom", error_kind="http_500")
    m = client_measurement([ok, ok, slow, failed], 10.0, SLO(ttft_p95_ms=1000, itl_p95_ms=100))
    assert m.completed == 3 and m.failed == 1 and m.throughput_rps == pytest.approx(0.3)
    assert m.goodput_rps == pytest.approx(0.2)
    assert m.extra["errors"] == {"http_500": 1} and len(m.extra["latencies"]["ttft_s"]) == 3
