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


def tries(used: list[int], count: int) -> list[int]:
    """Lengths of the runs of `count` in `used` (each run one try)."""
    runs, n = [], 0
    for u in [*used, None]:
        if u == count:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_a_try_ends_once_its_median_is_certain_and_tries_of_fewer_threads_back_off_past_the_regain_interval():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    used = run(adapter, clock, {2: 0.057, 1: 0.075}, 1100)  # ~63 s of steps, alone; 1 thread 1.3x slower
    assert adapter.choices() == {1: 2}
    runs = tries(used, 1)
    assert runs and all(n == 3 for n in runs), runs  # 3 of a 5-step window lost: the median cannot win
    # 0.5, 1, 2, 4, 8, 16, 32 s apart: 6 tries in a minute, where a 4 s cap would make 17
    assert 5 <= len(runs) <= 7, runs


def test_a_try_far_behind_at_its_first_step_ends_there():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    used = run(adapter, clock, {2: 0.057, 1: 0.095}, 300)  # 64 decode rows on 2-core Sapphire Rapids, alone
    assert adapter.choices() == {1: 2}
    runs = tries(used, 1)
    assert runs and all(n == 1 for n in runs), runs


def test_a_try_that_wins_ends_as_early():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    run(adapter, clock, {2: 0.005, 1: 0.0075}, 200)
    steps = 0
    while adapter.choices() != {1: 1}:  # a neighbour: the median's rise starts a try at once
        run(adapter, clock, {2: 0.015, 1: 0.0083}, 1)
        steps += 1
        assert steps < 20
    assert steps == 6  # 3 slow steps move the median, 3 of the try decide it (not the window's 5)


def test_at_fewer_threads_it_still_tries_more_every_few_seconds():
    clock = Clock()
    adapter = ThreadAdapter(2, clock=clock)
    run(adapter, clock, {2: 0.015, 1: 0.0083}, 3000)  # a neighbour for ~25 s: tries of 2 back off to 4 s
    assert adapter.choices() == {1: 1}
    left_s = clock.now
    while adapter.choices() != {1: 2}:  # the neighbour leaves
        run(adapter, clock, {2: 0.005, 1: 0.0075}, 1)
        assert clock.now - left_s < 4.5, "more threads were not tried within max_probe_interval_s"


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
