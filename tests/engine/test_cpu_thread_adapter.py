"""The decode steps' thread count follows the step times the engine measures: fewer threads when
the CPUs are busy (a neighbour, a quota), all of them again when they are free; the choice
never changes a greedy answer."""
from __future__ import annotations

import logging

import pytest

from kvpilot.engine.cpu.thread_adapter import ThreadAdapter, adapter_from_env, candidate_counts, rows_bucket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(adapter: ThreadAdapter, clock: Clock, step_s: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    """`steps` decode steps, each taking step_s[threads] seconds; the counts used."""
    used = []
    for _ in range(steps):
        n = adapter.threads_for(rows)
        used.append(n)
        adapter.record(rows, n, step_s[n])
        clock.now += step_s[n]
    return used


def test_counts_halve_down_to_one_and_rows_bucket_by_powers_of_two():
    assert candidate_counts(8) == [8, 4, 2, 1] and candidate_counts(3) == [3, 1] and candidate_counts(1) == [1]
    assert [rows_bucket(r) for r in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]


def test_alone_it_keeps_every_thread_and_tries_one_less_and_less_often():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    used = run(adapter, clock, {2: 0.005, 1: 0.0075}, 2000)  # 10 s of steps
    assert adapter.choices() == {1: 2}
    tries = sum(1 for a, b in zip(used, used[1:]) if a == 2 and b == 1)
    assert 3 <= tries <= 8, tries  # 0.5, 1, 2, 4, 4 s apart: a few tries, not one every interval
    assert used.count(1) / len(used) < 0.03  # the tries cost little


def test_beside_a_busy_neighbour_it_moves_to_fewer_threads_and_back_when_it_leaves(caplog):
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    run(adapter, clock, {2: 0.005, 1: 0.0075}, 200)
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.cpu.thread_adapter"):
        run(adapter, clock, {2: 0.015, 1: 0.0083}, 100)  # the neighbour arrives
    assert adapter.choices() == {1: 1}
    assert "decode steps of up to 1 row(s) now run 1 thread(s)" in caplog.text and "busier" in caplog.text
    run(adapter, clock, {2: 0.005, 1: 0.0075}, 1500)  # and leaves
    assert adapter.choices() == {1: 2}


def test_each_batch_size_has_its_own_choice():
    clock = Clock()
    adapter = ThreadAdapter(4, clock=clock)
    run(adapter, clock, {4: 0.010, 2: 0.006, 1: 0.009}, 400, rows=1)
    run(adapter, clock, {4: 0.020, 2: 0.030, 1: 0.050}, 400, rows=32)
    assert adapter.choices() == {1: 2, 32: 4}


def test_a_count_within_the_margin_is_not_taken():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    run(adapter, clock, {2: 0.0100, 1: 0.0095}, 1000)  # 5 % faster: noise, not a reason
    assert adapter.choices() == {1: 2}


def test_the_switch_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVPILOT_ADAPTIVE_THREADS", "0")
    assert adapter_from_env(4) is None
    monkeypatch.setenv("KVPILOT_ADAPTIVE_THREADS", "1")
    assert adapter_from_env(4).counts == [4, 2, 1] and adapter_from_env(1) is None
    monkeypatch.setenv("KVPILOT_ADAPTIVE_THREADS", "yes")
    with pytest.raises(ValueError, match="KVPILOT_ADAPTIVE_THREADS='yes'"):
        adapter_from_env(4)


def test_a_quota_applied_while_running_caps_every_count():
    clock, quota = Clock(), [None]
    adapter = ThreadAdapter(4, clock=clock, cap=lambda: 4 if quota[0] is None else quota[0])
    run(adapter, clock, {4: 0.004, 2: 0.006, 1: 0.010}, 300)
    assert adapter.choices() == {1: 4} and adapter.allowed() == 4
    quota[0] = 2  # a 2-CPU limit (an in-place resize, or the benchmark's quota)
    used = run(adapter, clock, {4: 0.004, 2: 0.006, 1: 0.010}, 600)
    assert adapter.allowed() == 2 and max(used[300:]) == 2 and adapter.choices() == {1: 2}
