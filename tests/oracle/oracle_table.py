"""The table of differences from vLLM (docs/vllm-differences.md) as the differential test
reads it, and the check of a run against it.

A row is a markdown table line whose first cell is a case id in backticks:
| `case id` | differs in | `vLLM signature` prose | `kvpilot signature` prose | status | reason |
The signatures (Outcome.signature, or `not sent`) are the backticked start of their cells;
status is one of STATUSES. The check fails on a difference without a row, on a row whose case
no longer differs (or differs otherwise than the row says) and on a row naming no case."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from oracle_run import Result, describe

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-differences.md"
DELIBERATE = "deliberate"
TO_FIX = "to fix (issue 48 item 2)"
TO_DECIDE = "to decide"  # seen here, neither deliberate nor on item 2's list: reported to the lead
STATUSES = (DELIBERATE, TO_FIX, TO_DECIDE)
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


@dataclass(frozen=True)
class Row:
    """One row of the table."""
    case: str
    aspect: str
    vllm: str
    ours: str
    status: str
    reason: str


def _signature(cell: str) -> str:
    match = re.match(r"`([^`]*)`", cell.strip())
    return match.group(1) if match else cell.strip()


def read_table(path: Path = DOC) -> dict[str, Row]:
    """The rows by case id. Raises ValueError on a malformed row or a repeated case."""
    rows: dict[str, Row] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _ROW.match(line)
        if not match:
            continue
        cells = [c.strip() for c in match.group(2).split("|")]
        if len(cells) != 5 or cells[3] not in STATUSES or not cells[4] or match.group(1) in rows:
            raise ValueError(f"{path.name}:{number}: a row needs 6 cells, a status in {STATUSES}, a reason, "
                             f"and a case of its own: {line}")
        rows[match.group(1)] = Row(match.group(1), cells[0], _signature(cells[1]), _signature(cells[2]), *cells[3:])
    return rows


def row_for(result: Result) -> str:
    """The table line a difference would need (status to decide), for the failure message."""
    return (f"| `{result.case.id}` | {result.aspect or 'status'} | {describe(result.theirs, result.aspect)} | "
            f"{describe(result.ours, result.aspect)} | {TO_DECIDE} | ? |")


def check(results: list[Result], rows: dict[str, Row]) -> list[str]:
    """Every way the run and the table disagree, one line each (empty: they agree)."""
    problems = []
    by_id = {r.case.id: r for r in results}
    for result in results:
        row = rows.get(result.case.id)
        differs = result.aspect is not None or result.theirs is None
        if differs and row is None:
            problems.append(f"a difference not in the table: {row_for(result)}")
        elif row is not None and not differs:
            problems.append(f"`{row.case}` no longer differs from vLLM ({row.status}): delete its row")
        elif row is not None:
            seen = (result.aspect or "status", _signature(describe(result.theirs, None)), result.ours.signature)
            if seen != (row.aspect, row.vllm, row.ours):
                problems.append(f"`{row.case}` differs otherwise than its row says: the row {row.aspect}, "
                                f"{row.vllm} / {row.ours}; seen {seen[0]}, {seen[1]} / {seen[2]}: {row_for(result)}")
    problems += [f"`{case}`: a row for a case that does not exist" for case in rows if case not in by_id]
    return problems


def summary(results: list[Result], rows: dict[str, Row]) -> str:
    """Counts for the test log: cases, compared, equal, listed differences by status."""
    sent = [r for r in results if r.theirs is not None]
    equal = [r for r in sent if r.aspect is None]
    greedy = [r for r in sent if r.case.greedy and r.theirs.status // 100 == 2 == r.ours.status // 100]
    greedy_equal = [r for r in greedy if r.aspect is None]
    unnamed = [r for r in equal if r.theirs.status // 100 == 4 and r.theirs.param is None and r.ours.param]
    listed = [rows[r.case.id] for r in results if r.case.id in rows and (r.aspect or r.theirs is None)]
    by_status = ", ".join(f"{s}: {sum(row.status == s for row in listed)}" for s in STATUSES)
    return (f"vLLM oracle: {len(results)} cases, {len(sent)} compared with vLLM 0.32, {len(equal)} equal, "
            f"{len(sent) - len(equal)} differ; {len(listed)} listed differences ({by_status}; "
            f"{len(results) - len(sent)} not sent to vLLM); greedy texts compared: {len(greedy)}, equal: "
            f"{len(greedy_equal)}; 4xx where vLLM names no param and kvpilot does: {len(unnamed)}")
