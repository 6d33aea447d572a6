"""The differential test's own logic, without servers: what counts as a difference
(oracle_compare.differing_aspect) and how a run is checked against the table (oracle_table)."""

from __future__ import annotations

import pytest
from oracle_compare import Case, Outcome, differing_aspect
from oracle_run import Result
from oracle_table import TO_FIX, Row, check, read_table

GREEDY = Case("g", "/v1/completions", {"prompt": "Hi", "temperature": 0})
SAMPLED = Case("s", "/v1/completions", {"prompt": "Hi", "temperature": 1.0})


def test_status_class_and_named_params_differ_but_a_null_vllm_param_does_not():
    assert differing_aspect(GREEDY, Outcome(400, "n"), Outcome(422, "n")) is None
    assert differing_aspect(GREEDY, Outcome(200), Outcome(400, "n")) == "status"
    assert differing_aspect(GREEDY, Outcome(400, "top_p"), Outcome(400, "n")) == "param"
    assert differing_aspect(GREEDY, Outcome(400, None), Outcome(400, "n")) is None
    assert differing_aspect(GREEDY, Outcome(200, stream_error=True), Outcome(200)) == "status"


def test_texts_count_for_greedy_requests_only_and_logprobs_within_the_tolerance():
    a, b = Outcome(200, texts=["x"], finish=["stop"]), Outcome(200, texts=["y"], finish=["stop"])
    assert differing_aspect(GREEDY, a, b) == "text" and differing_aspect(SAMPLED, a, b) is None
    near = Outcome(200, texts=["x"], finish=["stop"], logprobs=[[("x", -0.5)]])
    assert differing_aspect(GREEDY, near, Outcome(200, texts=["x"], finish=["stop"], logprobs=[[("x", -0.505)]])) is None
    assert differing_aspect(GREEDY, near, Outcome(200, texts=["x"], finish=["stop"], logprobs=[[("x", -0.6)]])) == \
        "logprobs"
    assert differing_aspect(SAMPLED, Outcome(200, usage=(5, 3)), Outcome(200, usage=(6, 3))) == "usage"


def _row(case: str, vllm: str = "2xx", ours: str = "4xx param=n") -> Row:
    return Row(case, "status", vllm, ours, TO_FIX, "why")


def test_the_check_fails_on_an_unlisted_difference_a_stale_row_and_a_changed_one():
    differ = Result(GREEDY, Outcome(200), Outcome(400, "n"), "status")
    equal = Result(SAMPLED, Outcome(200), Outcome(200), None)
    assert check([differ, equal], {"g": _row("g")}) == []
    assert "not in the table" in check([differ, equal], {})[0]
    assert "no longer differs" in check([differ, equal], {"g": _row("g"), "s": _row("s")})[0]
    assert "differs otherwise" in check([differ], {"g": _row("g", ours="4xx param=m")})[0]
    assert "does not exist" in check([differ], {"g": _row("g"), "x": _row("x")})[0]


def test_a_row_needs_a_known_status_and_a_reason(tmp_path):
    doc = tmp_path / "t.md"
    doc.write_text("| `a` | status | `2xx` | `5xx` | deliberate | vLLM dies |\n")
    assert read_table(doc)["a"].ours == "5xx"
    doc.write_text("| `a` | status | `2xx` | `5xx` | maybe | vLLM dies |\n")
    with pytest.raises(ValueError, match="a status in"):
        read_table(doc)
