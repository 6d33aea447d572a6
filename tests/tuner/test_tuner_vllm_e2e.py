"""`kvpilot tune --local --runtime vllm` against the pinned upstream vLLM (.venv-vllm, `make
vllm`): two restart trials on the builtin SmolLM2, the demo's story in small. The defaults'
KV cache holds three of the burst's longest requests, so vLLM's defaults (256 sequences)
preempt, counted by its own vllm:num_preemptions_total (its log shows a fuller cache); the
second trial is the guide's first remedy, the largest cache the search allows, on a restarted
vLLM with another --kv-cache-memory-bytes. --enforce-eager keeps a start to ~30-40 s on 2
cores, about 2 minutes in all."""
from __future__ import annotations

import json
import re
import socket

import pytest

from kvpilot.engine.settings import BY_NAME
from kvpilot.tuner import cli, demo
from kvpilot.tuner.local.vllm_runtime import REPO_ROOT, VLLM_CPU_BLOCK_SIZE, VLLM_MODULE, VLLM_VENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]
VLLM_PYTHON = REPO_ROOT / VLLM_VENV / "bin" / "python"


def test_two_restart_trials_on_upstream_vllm_measured_from_its_metrics(tmp_path):
    assert VLLM_PYTHON.exists(), "make test installs the pinned vLLM into .venv-vllm (scripts/install-vllm.sh)"
    sizes = demo.window_request_tokens(demo.MIN_OUTPUT)
    cache = demo.size_cache(max(sizes), VLLM_CPU_BLOCK_SIZE)
    assert sum(sizes) > cache.num_blocks * cache.block_size  # the defaults would run more than the cache holds
    kv = BY_NAME["kv_cache_memory_bytes"].flag
    bigger = 4 * cache.kv_cache_memory_bytes
    argv = ["--local", "--runtime", "vllm", "--model", demo.MODEL, "--max-model-len", str(demo.MAX_MODEL_LEN),
            f"--engine-arg={kv}={cache.kv_cache_memory_bytes}", "--engine-arg=--enforce-eager",
            "--trials", "2", "--remeasure-top", "0", "--report-dir", str(tmp_path),
            "--max-num-seqs", "2:256", "--chunked-prefill", "on", kv, f"{cache.kv_cache_memory_bytes}:{bigger}",
            *demo.workload_args(demo.MIN_OUTPUT), "--slo-ttft-ms", "0", "--slo-itl-ms", "0",
            "--max-preemptions-per-min", "0"]
    assert cli.main(argv) == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["meta"]["runtime"] == "vllm" and rep["meta"]["applied"] == ["restart", "restart"]
    assert rep["meta"]["machine"]["cores"] >= 1 and len(rep["meta"]["machine"]["loadavg_before"]) == 3
    first, second = sorted(rep["trials"], key=lambda t: t["number"])
    for trial in (first, second):
        m, settings = trial["measurement"], trial["settings"]
        assert m["source"] == "scrape" and m["completed"] == demo.BURST and m["failed"] == 0
        assert m["extra"]["server"]["completed"] == m["completed"]  # vllm:request_success_total over the window
        assert m["ttft_p95_s"] > 0 and m["itl_p95_s"] > 0  # vLLM's histograms
        reported = m["extra"]["reported_config"]  # vllm:cache_config_info of the vLLM that served the window
        assert reported["block_size"] == str(VLLM_CPU_BLOCK_SIZE) == str(settings["block_size"])
        assert reported["kv_cache_memory_bytes"] == str(settings["kv_cache_memory_bytes"])
    assert first["settings"]["max_num_seqs"] == 256 and first["settings"]["kv_cache_memory_bytes"] == \
        cache.kv_cache_memory_bytes
    assert first["measurement"]["preemptions"] > 0 and first["verdict"] == "violates_slo"
    assert second["settings"]["kv_cache_memory_bytes"] == bigger  # the guide's first remedy
    assert second["measurement"]["preemptions"] == 0 and rep["best"]["number"] == second["number"]
    log = (tmp_path / "engine.log").read_text()
    commands = [line.split()[1:] for line in log.splitlines() if line.startswith("=== ")]
    assert len(commands) == 2 and commands[0] != commands[1]
    for command, trial in zip(commands, (first, second)):
        assert command[:5] == [str(VLLM_PYTHON), "-P", "-m", VLLM_MODULE, "serve"]
        assert command[command.index(kv) + 1] == str(trial["settings"]["kv_cache_memory_bytes"])
        assert "--swap-space" not in command and "--preemption-mode" not in command
    assert "Initializing a V1 LLM engine (v0.32.0)" in log
    # vLLM 0.32 logs no line per preemption; its stats line (each second while busy:
    # VLLM_LOG_STATS_INTERVAL=1) shows the symptom: the defaults' cache fuller than the larger one,
    # which is never full (a 1 s sample may miss the defaults' moments at 100%)
    usage = [[float(u) for u in re.findall(r"KV cache usage: ([\d.]+)%", part)] for part in log.split("\n=== ")[1:]]
    assert all(len(u) >= 2 for u in usage)
    assert max(usage[0]) > max(usage[1]) and max(usage[1]) < 100
    ports = [int(c[c.index("--port") + 1]) for c in commands]
    for port in ports:  # both vLLM servers are gone
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "runtime: vllm" in (tmp_path / "inferenceservice.yaml").read_text()
