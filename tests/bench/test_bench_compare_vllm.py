"""`kvpilot bench compare --max-concurrency` (issue 49 item 1): upstream vLLM beside kvpilot-dense
and kvpilot, one client for all, servers in alternating order. Pure parts without a server; one
slow test runs vLLM (.venv-vllm, `make vllm`) and kvpilot-dense for real through `vllm bench serve`."""

import json
import os
import sys
from pathlib import Path

import pytest

from kvpilot.bench import compare, compare_concurrency, compare_concurrency_report, compare_peers, compare_vllm, serve

VLLM_PYTHON = compare_vllm.default_vllm_python()


def parse(*argv):
    a, serve_args = compare.build_parser().parse_known_args(list(argv))
    return a, serve_args


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-concurrency", "0,16"], "--max-concurrency takes integers >= 1"),
    (["--max-concurrency", "1,sixteen"], "--max-concurrency takes integers >= 1"),
    (["--max-concurrency", "1", "--request-rates", "1"], "not both"),
    (["--max-concurrency", "1", "--repeats", "0"], "--repeats must be >= 1"),
    (["--max-concurrency", "1", "--peers", "vllm,sglang"], "--peers takes names from"),
    (["--max-concurrency", "1", "--peers", "vllm,llama-server"], "drop llama-server from --peers"),
    (["--max-concurrency", "1", "--max-output-len", "0"], "--max-output-len must be >= 1"),
])
def test_bad_concurrency_flags_exit_2_saying_what_to_change(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        compare.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_missing_vllm_exits_2_naming_make_vllm(tmp_path, capsys):
    no_vllm = tmp_path / "python"
    no_vllm.write_text("#!/bin/sh\nexit 1\n")
    no_vllm.chmod(0o755)  # an executable without the `vllm` script beside it
    assert compare.main(["--max-concurrency", "1", "--vllm-python", str(no_vllm)]) == 2
    err = capsys.readouterr().err
    assert "make vllm" in err and "--vllm-python" in err
    assert compare.main(["--request-rates", "1", "--peers", "vllm", "--vllm-python", str(no_vllm)]) == 2
    assert "make vllm" in capsys.readouterr().err


def test_levels_keep_their_order_and_runs_have_twice_the_concurrency_at_least():
    assert compare_concurrency.parse_levels("1,16,64,16") == [1, 16, 64]
    assert [compare_concurrency.prompts_for(c, 32) for c in (1, 16, 64)] == [32, 32, 128]


def test_servers_alternate_abba_over_levels_and_repeats():
    order = compare_concurrency.schedule(["vllm", "kvpilot-dense"], [1, 16], repeats=2)
    assert order == [(0, 1, ["vllm", "kvpilot-dense"]), (0, 16, ["kvpilot-dense", "vllm"]),
                     (1, 1, ["vllm", "kvpilot-dense"]), (1, 16, ["kvpilot-dense", "vllm"])]
    three = compare_concurrency.schedule(["a", "b", "c"], [1, 16, 64], repeats=1)
    assert [o for _, _, o in three] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # every server runs first as often as last over an even number of passes
    firsts = [o[0] for _, _, o in order]
    assert firsts.count("vllm") == firsts.count("kvpilot-dense")


def test_concurrency_mode_defaults_fit_sharegpt_and_the_highest_level(capsys):
    a, _ = parse("--max-concurrency", "1,16,64", "--vllm-python", "/nonexistent")
    assert compare_concurrency.check(compare.build_parser(), a)[1:] == (["vllm", "kvpilot-dense", "kvpilot"], 2)
    assert a.max_model_len == 2048 and a.max_num_seqs == 64  # prompts up to 1024 tokens + 128 out, 64 in flight


def test_vllm_serves_the_dense_directory_in_the_dtype_with_the_same_limits():
    a, _ = parse("--max-concurrency", "1", "--vllm-python", "/venv/bin/python", "--max-model-len", "2048",
                 "--max-num-seqs", "64", "--vllm-arg=--enforce-eager")
    cmd, health = compare_peers.peer_command("vllm", Path("m.gguf"), a, [], model_dir=Path("/cache/smollm2"))
    assert cmd[:5] == ["/venv/bin/python", "-P", "-m", "vllm.entrypoints.cli.main", "serve"]
    assert cmd[5] == "/cache/smollm2" and health == "/health"
    for flag, value in [("--served-model-name", "smollm2-135m-instruct"), ("--max-model-len", "2048"),
                        ("--max-num-seqs", "64"), ("--dtype", "bfloat16")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[-1] == "--enforce-eager"


def test_vllm_gets_kvpilots_kv_cache_bytes_unless_told(monkeypatch):
    """Both engines the same KV cache: VLLM_CPU_KVCACHE_SPACE's bytes (4 GiB unset), unless a
    --vllm-arg sizes vLLM's own."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    a, _ = parse("--max-concurrency", "1", "--vllm-python", "/venv/bin/python")
    cmd, _ = compare_peers.peer_command("vllm", Path("m.gguf"), a, [], model_dir=Path("/m"))
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd, _ = compare_peers.peer_command("vllm", Path("m.gguf"), a, [], model_dir=Path("/m"))
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    a, _ = parse("--max-concurrency", "1", "--vllm-python", "/venv/bin/python", "--vllm-arg=--gpu-memory-utilization=0.5")
    cmd, _ = compare_peers.peer_command("vllm", Path("m.gguf"), a, [], model_dir=Path("/m"))
    assert "--kv-cache-memory-bytes" not in cmd and cmd[-1] == "--gpu-memory-utilization=0.5"


def test_kvpilot_dense_gets_the_dequantized_weights_in_vllms_dtype_and_kvpilot_its_defaults():
    a, serve_args = parse("--max-concurrency", "1", "--max-model-len", "2048", "--max-num-seqs", "16",
                          "--quantization", "gguf")
    dense, _ = compare_peers.peer_command("kvpilot-dense", Path("m.gguf"), a, serve_args)
    ours, _ = compare_peers.peer_command("kvpilot", Path("m.gguf"), a, serve_args)
    tail = dense[-4:]  # last: wins over the pass-through
    assert tail[tail.index("--quantization") + 1] == "none" and tail[tail.index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in ours and ours[-2:] == ["--quantization", "gguf"]
    a, _ = parse("--max-concurrency", "1", "--dtype", "float32")
    assert compare_peers.peer_command("kvpilot", Path("m.gguf"), a, [])[0][-2:] == ["--dtype", "float32"]
    vllm = compare_peers.peer_command("vllm", Path("m.gguf"), a, [], model_dir=Path("/d"))[0]
    assert vllm[vllm.index("--dtype") + 1] == "float32"


def test_vllm_environment_frees_the_reserved_cpu_and_unpins_threads(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    a, _ = parse("--max-concurrency", "1", "--threads", "2")
    env = compare_peers.peer_env("vllm", a)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "2"
    assert compare_peers.peer_env("kvpilot-dense", a) is None  # inherits OMP_NUM_THREADS = --threads


@pytest.mark.parametrize("client", ["vllm", "kvpilot"])
def test_both_clients_get_the_same_run(client, tmp_path):
    a, _ = parse("--max-concurrency", "16", "--vllm-python", "/venv/bin/python", "--seed", "3")
    cmd = compare_vllm.client_command(client, a.vllm_python, "http://127.0.0.1:9", a, Path("/tok"),
                                      Path("/sharegpt.json"), 32, 16, tmp_path / "r.json")
    head = (["/venv/bin/python", "-P", "-m", "vllm.entrypoints.cli.main"] if client == "vllm"
            else [sys.executable, "-P", "-m", "kvpilot.cli.main"])
    assert cmd[:len(head)] == head and cmd[len(head):len(head) + 2] == ["bench", "serve"]
    tail = " ".join(cmd[len(head):])
    for part in ["--backend openai", "--base-url http://127.0.0.1:9", "--model smollm2-135m-instruct",
                 "--tokenizer /tok", "--dataset-name sharegpt", "--dataset-path /sharegpt.json",
                 "--sharegpt-output-len 128", "--num-prompts 32", "--max-concurrency 16", "--request-rate inf",
                 "--seed 3", "--percentile-metrics ttft,tpot,itl,e2el", "--metric-percentiles 50,95,99",
                 "--save-result", f"--result-dir {tmp_path}", "--result-filename r.json"]:
        assert part in tail
    if client == "kvpilot":  # our client takes every flag vLLM's gets
        ours = serve.build_parser().parse_args(cmd[len(head) + 2:])
        assert ours.max_concurrency == 16 and ours.sharegpt_output_len == 128 and ours.save_result


def run(server, level, repeat, tok_s, ttft, **extra):
    return {"repeat": repeat, "concurrency": level, "server": server, "position": 0, "num_prompts": 32,
            "loadavg_before": [1.0, 0.8, 0.5], "loadavg_after": [2.0, 1.1, 0.6], "completed": 32, "failed": 0,
            "output_throughput": tok_s,
            "median_ttft_ms": ttft, "p95_ttft_ms": 2 * ttft, "median_itl_ms": 10.0, **extra}


def test_ratios_to_vllm_are_taken_within_a_pass_and_the_table_has_a_row_per_level_and_server():
    runs = [run("vllm", 1, 0, 100.0, 50.0), run("kvpilot-dense", 1, 0, 50.0, 100.0),
            run("vllm", 1, 1, 50.0, 50.0), run("kvpilot-dense", 1, 1, 50.0, 50.0),
            run("vllm", 16, 0, 400.0, 80.0), {**run("kvpilot-dense", 16, 0, 0, 0), "error": "client exited with 1"}]
    summary = compare_concurrency_report.summarize(runs, [1, 16], ["vllm", "kvpilot-dense"])
    dense = summary[1]["kvpilot-dense"]
    assert dense["output_ratio_to_vllm"] == pytest.approx(0.75)  # median of 0.5 and 1.0, not 50/75
    assert dense["ttft_ratio_to_vllm"] == pytest.approx(1.5) and dense["runs"] == 2
    assert summary[16]["kvpilot-dense"]["failed_runs"] == 1 and summary[16]["kvpilot-dense"]["runs"] == 0
    rows = compare_concurrency_report.markdown_table(summary).splitlines()
    assert rows[0].startswith("| concurrency | server |") and len(rows) == 6
    assert rows[2] == "| 1 | vllm | 2 | 75.0 | 50 | 100 | 10.0 | 1.00 | 1.00 | 0 | 1.0-2.0 |"
    assert rows[5] == "| 16 | kvpilot-dense | 0 | - | - | - | - | - | - | 0 | 1.0-2.0 |"


def test_result_keys_are_read_from_a_save_result_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"completed": 4, "failed": 0, "output_throughput": 12.5, "median_ttft_ms": 80.0,
                                "p95_ttft_ms": 120.0, "median_itl_ms": 30.0, "ttfts": [0.1] * 4, "date": "x"}))
    assert compare_vllm.read_result(path) == {"completed": 4, "failed": 0, "output_throughput": 12.5,
                                              "median_ttft_ms": 80.0, "p95_ttft_ms": 120.0, "median_itl_ms": 30.0}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_and_kvpilot_dense_run_through_vllm_bench_serve(tmp_path):
    assert VLLM_PYTHON is not None, "no .venv-vllm: `make test` installs it (`make vllm`)"
    out = tmp_path / "cmp"
    code = compare.main(["--max-concurrency", "2", "--num-prompts", "4", "--max-output-len", "16",
                         "--peers", "vllm,kvpilot-dense", "--threads", str(min(2, os.cpu_count() or 1)),
                         "--max-model-len", "2048", "--vllm-arg=--enforce-eager",
                         "--vllm-arg=--kv-cache-memory-bytes=268435456", "--startup-timeout", "300",
                         "--request-timeout", "300", "--output-dir", str(out)])
    data = json.loads((out / "compare.json").read_text())
    assert code == 0, data["runs"]
    assert data["client"] == "vllm bench serve" and data["eager"] is True and data["versions"]["vllm"]
    assert data["machine"]["cpu"] and len(data["machine"]["loadavg_after"]) == 3  # kvpilot.loadgen.machine
    assert [(r["server"], r["concurrency"]) for r in data["runs"]] == [("vllm", 2), ("kvpilot-dense", 2)]
    for r in data["runs"]:
        assert r["completed"] == 4 and r["failed"] == 0 and r["max_concurrency"] == 2
        assert r["output_throughput"] > 0 and r["p95_ttft_ms"] >= r["median_ttft_ms"] > 0 and r["median_itl_ms"] > 0
        assert r["loadavg_before"][0] >= 0 and r["loadavg_after"][0] >= 0
    assert data["summary"]["2"]["vllm"]["output_ratio_to_vllm"] == pytest.approx(1.0)
    assert "| 2 | kvpilot-dense | 1 |" in (out / "compare.md").read_text()
