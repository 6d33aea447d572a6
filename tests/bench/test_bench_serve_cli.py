"""`kvpilot bench serve` as a command: flag validation, and whole runs against the
conftest's SSE test peer with the real ShareGPT data and SmolLM2 tokenizer."""

import json
import socket

import pytest

from kvpilot.bench import serve


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--burstiness", "-1"], "--burstiness must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--goodput", "itl:5"], "invalid goodput metric"),
    (["--goodput", "ttft=5"], "KEY:VALUE"),
    (["--endpoint", "/generate"], "must end with /completions"),
    (["--percentile-metrics", "ttft,foo"], "unknown ['foo']"),
    (["--metric-percentiles", "0"], "(0, 100]"),
    (["--metadata", "novalue"], "KEY=VALUE"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--random-range-ratio", "1"], "[0, 1)"),
    (["--request-rate", "fast"], "invalid float value"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def peer_tokenizer(monkeypatch, smollm2_tokenizer):
    # The tokenizer is resolved from --tokenizer/--model; reuse the session's parsed one.
    names = []
    monkeypatch.setattr(serve, "load_tokenizer", lambda name: names.append(name) or smollm2_tokenizer)
    return names


def test_sharegpt_run_saves_vllm_result_file(sse_peer, peer_tokenizer, tmp_path, capsys, monkeypatch):
    url, stats = sse_peer
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    code = serve.main(["--base-url", url, "--num-prompts", "5", "--disable-shuffle", "--request-rate", "50",
                       "--goodput", "ttft:10000", "e2el:60000", "--save-result", "--result-dir", str(tmp_path),
                       "--metadata", "engine=peer", "--disable-tqdm"])
    assert code == 0
    assert peer_tokenizer == ["test-peer-model"]  # --model defaulted to the server's first model
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Successful requests" in out and "P99 TTFT (ms)" in out
    [path] = list(tmp_path.glob("openai-50.0qps-test-peer-model-*.json"))
    data = json.loads(path.read_text())
    for key in ["date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "p95_itl_ms", "mean_e2el_ms", "p90_e2el_ms", "max_concurrent_requests"]:
        assert key in data, key
    assert "ttfts" not in data and "generated_texts" not in data  # only with --save-detailed
    assert data["engine"] == "peer" and data["num_prompts"] == 5 and data["request_rate"] == 50.0
    assert (data["completed"], data["failed"]) == (5, 0)
    assert data["total_input_tokens"] == 5 * 7  # the server's usage.prompt_tokens wins
    # the peer streams exactly max_tokens tokens: the ShareGPT reference lengths
    expected = serve.sample_sharegpt_requests(serve.load_tokenizer("x"), 5, shuffle=False)
    assert data["total_output_tokens"] == sum(r.expected_output_len for r in expected)
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["error_counts"] == {}
    assert stats["auth"][-5:] == ["Bearer sk-test"] * 5


def test_unreachable_server_counts_connect_failures(peer_tokenizer, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code = serve.main(["--port", str(port), "--model", "m", "--endpoint", "chat", "--dataset-name", "random",
                           "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "3",
                           "--save-result", "--save-detailed", "--result-filename", "r.json",
                           "--result-dir", str(tmp_path), "--disable-tqdm"])
    assert code == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["backend"] == "openai-chat"
    assert (data["completed"], data["failed"]) == (0, 3)
    assert data["error_counts"] == {"connect": 3}
    assert all("cannot connect" in e for e in data["errors"])
    assert "failed: connect" in capsys.readouterr().out


def test_model_lookup_failure_exits_1(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        code = serve.main(["--port", str(s.getsockname()[1])])
    assert code == 1
    assert "pass --model" in capsys.readouterr().err
