"""`kvpilot bench sampling-params`, as benchmarks/README.md shows it, on a small run: every
mode makes the same number of tokens (ignore_eos), the modes set what they say on every
request, and the ratios are against the run's own no-parameter mode."""
from __future__ import annotations

import json

import pytest

from kvpilot.bench import sampling_params_cost


@pytest.mark.slow
def test_the_benchmark_times_each_mode_against_none_in_one_run(tmp_path):
    out = tmp_path / "sp.json"
    assert sampling_params_cost.main(["--num-prompts", "3", "--max-tokens", "4", "--repeats", "1", "--dtype",
                                      "float32", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    names = list(sampling_params_cost.modes(20, 4))
    assert list(r["modes"]) == names and [r[m]["output_tokens"] for m in names] == [12] * len(names)
    assert r["over_none"]["none"] == 1.0 and all(v > 0 for v in r["over_none"].values())
    assert r["modes"]["all"]["repetition_penalty"] == 1.2 and len(r["modes"]["logit_bias"]["logit_bias"]) == 20
    m = r["machine"]  # the one machine block (kvpilot.loadgen.machine)
    assert len(m["loadavg_before"]) == 3 and len(m["loadavg_after"]) == 3 and m["cpu"] and m["cores"] >= 1
