"""`kvpilot bench structured-outputs`, as benchmarks/README.md shows it, on a small run: every
mode makes the same number of tokens, the grammar's calls are timed only where there is a
grammar, and every grammar's compile time is reported cold and cached."""
from __future__ import annotations

import json

import pytest

from kvpilot.bench import structured_outputs


@pytest.mark.slow
def test_the_benchmark_times_each_mode_and_every_grammars_compile(tmp_path):
    out = tmp_path / "so.json"
    assert structured_outputs.main(["--num-prompts", "2", "--max-tokens", "4", "--repeats", "1", "--dtype", "float32",
                                    "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [r[m]["output_tokens"] for m in structured_outputs.MODES] == [8, 8, 8]
    assert r["without_schema"]["grammar_s"] == 0 and r["json_schema"]["grammar_ms_per_step"] > 0
    assert set(r["compile"]["grammars"]) == set(structured_outputs.GRAMMARS)
    assert set(r["machine"]) == {"cpu", "flags", "cores", "loadavg_before", "loadavg_after"}  # kvpilot.loadgen.machine
    assert all(g["cold_ms"] > 0 and g["cached_ms"] > 0 for g in r["compile"]["grammars"].values())
