"""The before/after table in vLLM's tuning-guide terms, from a report (no engine)."""
from __future__ import annotations

from pathlib import Path

from kvpilot.tuner.report import story

SLO = {"ttft_p95_ms": 9000.0, "itl_p95_ms": 300.0, "e2e_p95_ms": 0.0, "max_preemptions_per_min": 0.0}
BASE = {"max_model_len": 256, "max_num_seqs": 256, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9,
        "enable_chunked_prefill": True, "kv_cache_memory_bytes": 6635520, "performance_mode": None}


def _trial(number, settings, verdict, preemptions, goodput, remeasure_of=None, defaults=False):
    m = {"preemptions_per_min": preemptions, "ttft_p95_s": 2.0, "itl_p95_s": 0.2, "goodput_rps": goodput}
    return {"number": number, "settings": settings, "verdict": verdict, "measurement": m,
            "remeasure_of": remeasure_of, "is_defaults": defaults}


def report():
    tuned = dict(BASE, max_num_seqs=3, max_num_batched_tokens=512)
    return {"slo": SLO, "defaults": {"number": 0, "feasible": False},
            "best": {"number": 1},
            "trials": [_trial(0, BASE, "violates_slo", 6.0, 0.5, defaults=True),
                       _trial(1, tuned, "measured", 0.0, 0.4), _trial(2, tuned, "measured", 0.0, 0.6, remeasure_of=1)]}


def test_before_after_names_the_guides_remedies_and_the_goodput_within_the_slos(tmp_path):
    text = story.before_after(report())
    assert "lower max_num_seqs 256 -> 3" in text and "decrease max_num_seqs" in text
    assert "lower max_num_batched_tokens 2048 -> 512" in text
    assert "kv_cache_memory_bytes" not in text.split("changed")[1]  # unchanged settings are not listed
    assert "defaults 0.000 req/s, tuned 0.500 req/s" in text  # the defaults' window broke the SLOs
    defaults_row = next(line for line in text.splitlines() if line.startswith("defaults"))
    assert defaults_row.split()[1:3] == ["6.0", "2000"] and defaults_row.endswith("0/1")
    assert next(line for line in text.splitlines() if line.startswith("tuned")).endswith("2/2")
    assert story.write_plot(report(), tmp_path).stat().st_size > 0


def test_kept_defaults_print_no_changes():
    rep = report()
    rep["best"] = {"number": 0}
    text = story.before_after(rep)
    assert "the tuner kept the defaults" in text and "changed" not in text
    assert story.write_plot(rep, Path("/nonexistent")) is None
