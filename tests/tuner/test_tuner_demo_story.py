"""The demo's story on the CPU that runs the test (issue 33): with the KV cache the demo
sizes from this machine's dtype and a burst of ShareGPT requests, the engine defaults
(256 sequences) are preempted (vLLM's warning in the engine log, vllm:num_preemptions_total
rising) and the tuner's winner is not. The demo's burst with its shortest replies and two trials keep
it to a minute or two on a 2-core CPU; the SLOs are the preemption limit alone, so the verdict
depends on tokens and blocks, not on this CPU's speed."""
from __future__ import annotations

import json

from kvpilot.engine.settings import BY_NAME
from kvpilot.tuner import cli, demo
from kvpilot.tuner.report import story

PREEMPTION_WARNING = ("is preempted by PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. "
                      "This can affect the end-to-end performance. Increase gpu_memory_utilization")


def test_the_defaults_preempt_under_the_demo_burst_and_the_tuners_winner_does_not(tmp_path):
    burst, output = demo.BURST, demo.MIN_OUTPUT
    sizes = demo.window_request_tokens(output, burst)
    cache = demo.size_cache(max(sizes))
    assert sum(sizes) > cache.num_blocks * cache.block_size  # the defaults would run more than the cache holds
    argv = ["--local", "--model", demo.MODEL, BY_NAME["max_model_len"].flag, str(demo.MAX_MODEL_LEN),
            f"--engine-arg={BY_NAME['kv_cache_memory_bytes'].flag}={cache.kv_cache_memory_bytes}",
            "--trials", "2", "--remeasure-top", "0", "--report-dir", str(tmp_path), *demo.SEARCH,
            *demo.workload_args(output, burst), "--slo-ttft-ms", "0", "--slo-itl-ms", "0",
            "--max-preemptions-per-min", "0"]
    assert cli.main(argv) == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    trials = {t["number"]: t for t in rep["trials"]}
    defaults, best = trials[rep["defaults"]["number"]], trials[rep["best"]["number"]]
    assert defaults["settings"]["max_num_seqs"] == 256
    assert defaults["measurement"]["preemptions"] > 0 and defaults["verdict"] == "violates_slo"
    assert defaults["measurement"]["source"] == "scrape"  # vllm:num_preemptions_total, read from /metrics
    assert best["measurement"]["preemptions"] == 0 and best["verdict"] == "measured"
    # the guide's remedy, sized by the memory model: as many of the longest request as the cache holds
    assert best["settings"]["max_num_seqs"] == demo.CACHE_REQUESTS
    assert PREEMPTION_WARNING in (tmp_path / "engine.log").read_text()
    text = story.before_after(rep)
    assert f"lower max_num_seqs 256 -> {demo.CACHE_REQUESTS}" in text and "decrease max_num_seqs" in text
    assert story.write_plot(rep, tmp_path).stat().st_size > 0
