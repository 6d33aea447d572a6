"""vLLM as the oracle of every request (issue 48 item 1): the cases of kvpilot's request tests,
structured outputs and tools, the cases issue 48 names and fuzz-drawn ones, streamed and not,
on both generation routes, are sent to vLLM 0.32 and to kvpilot on the same model (float32
dense weights on both) and compared on status class, the error's param, and for greedy
requests the text, finish_reason and token ids (oracle_compare.py). Every difference is a row
of docs/vllm-differences.md, deliberate (with the reason) or still to fix; the test fails on a
difference without a row and on a row that no longer differs. The summary line (cases, equal,
listed) goes to the test log."""

from __future__ import annotations

import time

import pytest
from oracle_cases import request_test_cases
from oracle_cases_structured import structured_cases
from oracle_compare import Case
from oracle_fuzz import fuzz_cases
from oracle_run import run_all
from oracle_table import DOC, read_table
from oracle_table import check as check_table
from oracle_table import summary as table_summary


def all_cases() -> list[Case]:
    """Every case the differential test sends, in a fixed order."""
    return request_test_cases() + structured_cases() + fuzz_cases()


def test_case_ids_are_unique_and_every_row_names_a_case():
    ids = [case.id for case in all_cases()]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    rows = read_table()
    assert rows, f"no rows read from {DOC}"
    assert set(rows) <= set(ids), sorted(set(rows) - set(ids))


def test_fuzz_cases_are_the_same_for_the_same_seed():
    assert [(c.id, c.body) for c in fuzz_cases()] == [(c.id, c.body) for c in fuzz_cases()]


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 3 minutes on an idle 2-core machine, vLLM's start-up included
def test_every_case_answers_as_vllm_does_or_as_the_table_says(servers, capsys):
    vllm, ours = servers
    start = time.monotonic()
    results = run_all(vllm.url, ours.url, all_cases())
    rows = read_table()
    with capsys.disabled():
        print(f"\n{table_summary(results, rows)}; sent in {time.monotonic() - start:.0f} s")
    assert vllm.alive(), f"vLLM's server died during the run:\n{vllm.log_tail()}"
    problems = check_table(results, rows)
    assert not problems, "\n".join(problems)
