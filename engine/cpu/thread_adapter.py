"""How many of its threads a CPU engine's decode steps use, chosen from the step times it measures.

A pod's CPUs are shared: a neighbour with an equal CPU request (another cgroup of equal weight)
takes one CPU of two away in time slices of milliseconds, a CPU limit throttles the group for
the rest of its period. A decode step of N threads meets at a barrier a few hundred times, so
when one of its threads is descheduled all of them wait, and beyond a certain level of
contention one thread without barriers is faster than N with them (2-core Zen 4, one stream of
the builtin model: 2 threads 5 ms a token alone but 15 ms beside a busy neighbour, 1 thread 7.5 ms
alone and 8.3 ms beside it; benchmarks/results/shared_node). No static count is right for both,
so the engine measures: per step shape (decode rows, bucketed by powers of two) it keeps the
recent step times of the count it runs, tries each other count (N, N/2, ..., 1) for a few steps
now and then, and moves to one whose median is clearly lower. A try ends as soon as its outcome is
certain: once most of its window is on one side of the bar, the median of the full window could
not land on the other; and at its first step where that step took over `give_up` (1.5) times the
median of the count in use, as a count that wins does not start that far behind (2-core Sapphire
Rapids, 64 decode rows, alone: 1 thread ~95 ms a step against ~57 ms with 2, so each step of a
try costs ~40 ms; beside a busy neighbour the count in use is the slower one).
A try that loses waits twice as long before the next: up to `max_probe_interval_s` for more
threads than in use (the CPUs a neighbour gave back show up only in a try), up to
`max_fewer_interval_s` for fewer, since a neighbour's arrival shows up without one: the median of
the count in use rising by half over the one it was chosen with starts a try at once. Tries of
fewer threads every 4 s, 5 steps each, cost a decode-heavy run ~5 % of its time on an idle
2-core machine (128 ShareGPT requests, 64 at a time, offline: 18.3 s with them, 17.3 s without the
adapter, 17.9 s with the rules above).

Every step runs at most ceil(the cgroup's CPU quota) threads, re-read every second (a limit
applied or resized while the engine runs): more would exhaust the quota early in each 100 ms
period and stall until the next.
Only decode-only steps adapt: their C kernels give the same result with any number of threads
(each output of a matmul is computed by one thread; decode attention partitions sequences by
the engine's planned thread count, not the running one: kernels/cpu/threads.py), so a greedy
answer does not depend on the moment. Prefill and mixed steps run the planned count. A thread
count set by hand (torch.set_num_threads after the engine started) stops the adapter; so does
`KVPILOT_ADAPTIVE_THREADS=0`.
Source: the same feedback idea as llama.cpp's `--poll` (spin while it pays, then sleep) applied
to the team size; Linux CFS group scheduling (Documentation/scheduler/sched-design-CFS.rst).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.engine.cpu.threads import cgroup_cpu_quota
from kvpilot.engine.settings.env import KVPILOT_ADAPTIVE_THREADS

logger = logging.getLogger(__name__)
ADAPTIVE_ENV = KVPILOT_ADAPTIVE_THREADS


def candidate_counts(max_threads: int) -> list[int]:
    """The team sizes tried: max_threads, then halved down to 1 (e.g. 8 -> [8, 4, 2, 1])."""
    counts, n = [], max(1, max_threads)
    while n > 1:
        counts.append(n)
        n //= 2
    return [*counts, 1]


def rows_bucket(rows: int) -> int:
    """Decode rows rounded up to a power of two: steps of one bucket are timed together."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Shape:
    current: int
    times: dict[int, deque] = field(default_factory=dict)
    reference_s: float = 0.0  # the current count's median when it was chosen
    probing: int | None = None
    due_s: dict[int, float] = field(default_factory=dict)  # when each other count is tried next
    interval_s: dict[int, float] = field(default_factory=dict)


class ThreadAdapter:
    """Chooses the thread count of each decode step (`threads_for`) from the times `record`
    is told. `samples`: steps per median; `probe_interval_s`: the first wait before trying
    another count, doubled per lost try up to `max_probe_interval_s` (a count above the one in
    use) or `max_fewer_interval_s` (below it); `margin`: how much faster (fraction) a count must
    be to be taken; `give_up`: a try whose first step is slower than this many times the count in
    use's median ends there."""

    def __init__(self, max_threads: int, *, samples: int = 5, probe_interval_s: float = 0.5,
                 max_probe_interval_s: float = 4.0, max_fewer_interval_s: float = 32.0, margin: float = 0.1,
                 give_up: float = 1.5,
                 clock: Callable[[], float] = time.monotonic, cap: Callable[[], int] | None = None,
                 cap_every_s: float = 1.0) -> None:
        self.counts = candidate_counts(max_threads)
        self.samples, self.margin, self.clock = samples, margin, clock
        self.probe_interval_s, self.max_probe_interval_s = probe_interval_s, max_probe_interval_s
        self.max_fewer_interval_s, self.give_up = max_fewer_interval_s, give_up
        self._shapes: dict[int, _Shape] = {}
        self._cap, self._cap_every_s = cap, cap_every_s
        self._allowed, self._cap_read_s = self.counts[0], -math.inf

    @property
    def max_threads(self) -> int:
        """The largest thread count it may choose: the max_threads it was built with (at least 1)."""
        return self.counts[0]

    def allowed(self) -> int:
        """The most threads a step may use now: max_threads, or fewer where `cap` (the cgroup's CPU
        quota rounded up, re-read every cap_every_s) says so: more threads than the quota only
        exhaust it early in the period and wait for the next (a pod's limit can change while it
        runs: Kubernetes' in-place resize)."""
        if self._cap is not None and self.clock() - self._cap_read_s >= self._cap_every_s:
            self._cap_read_s = self.clock()
            self._allowed = max(1, min(self.max_threads, self._cap()))
        return self._allowed

    def _shape(self, bucket: int) -> _Shape:
        shape = self._shapes.get(bucket)
        if shape is None:
            shape = self._shapes[bucket] = _Shape(self.max_threads)
            shape.times = {n: deque(maxlen=self.samples) for n in self.counts}
            self._reset_tries(shape, self.clock() + self.probe_interval_s)
        return shape

    def _reset_tries(self, shape: _Shape, due_s: float) -> None:
        shape.interval_s = {n: self.probe_interval_s for n in self.counts}
        shape.due_s = {n: due_s for n in self.counts if n != shape.current}

    def threads_for(self, rows: int) -> int:
        """The team size for a decode step of `rows` rows."""
        if len(self.counts) == 1:
            return 1
        shape = self._shape(rows_bucket(rows))
        allowed = self.allowed()
        if shape.current > allowed:  # the quota shrank: the largest count it allows, tries among those
            shape.current = next(n for n in self.counts if n <= allowed)
            shape.probing, shape.reference_s = None, 0.0
            self._reset_tries(shape, self.clock() + self.probe_interval_s)
        if shape.probing is None and len(shape.times[shape.current]) == self.samples:
            due = {n: t for n, t in shape.due_s.items() if n <= allowed}
            nxt = min(due, key=due.__getitem__, default=None)
            if nxt is not None and self.clock() >= due[nxt]:
                shape.probing = nxt
                shape.times[nxt].clear()
        return shape.current if shape.probing is None else shape.probing

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds` with `threads` threads."""
        if len(self.counts) == 1:
            return
        shape = self._shape(rows_bucket(rows))
        shape.times[threads].append(seconds)
        if shape.probing is None:
            current = shape.times[shape.current]
            if threads != shape.current or len(current) < self.samples:
                return
            median = statistics.median(current)
            if not shape.reference_s:
                shape.reference_s = median
            elif median > 1.5 * shape.reference_s:  # slower than when chosen: try the others now
                shape.reference_s = median
                self._reset_tries(shape, 0.0)
        elif threads == shape.probing:
            self._decide(shape, rows)

    def _decide(self, shape: _Shape, rows: int) -> None:
        """Ends the try once its full window's median is certain to fall below the bar (the count in
        use's median less the margin) or not to: more than half of the window on one side decides it;
        a first step over `give_up` times the count in use's median loses at once."""
        tried, was = shape.probing, shape.current
        times = shape.times[tried]
        current_s = statistics.median(shape.times[was])
        bar_s = current_s * (1 - self.margin)
        majority = self.samples // 2 + 1
        faster = sum(1 for t in times if t < bar_s)
        far_behind = len(times) == 1 and times[0] > self.give_up * current_s
        if faster < majority and len(times) - faster < majority and not far_behind:
            return
        tried_s = statistics.median(times)
        shape.probing = None
        now = self.clock()
        if faster >= majority:
            shape.current, shape.reference_s = tried, tried_s
            self._reset_tries(shape, now + self.probe_interval_s)
            logger.info("CPU threads: decode steps of up to %d row(s) now run %d thread(s): %.1f ms a step against "
                        "%.1f with %d (the CPUs are %s)", rows_bucket(rows), tried, tried_s * 1e3, current_s * 1e3,
                        was, "busier" if tried < was else "freer")
        else:
            cap_s = self.max_fewer_interval_s if tried < was else self.max_probe_interval_s
            shape.interval_s[tried] = min(cap_s, 2 * shape.interval_s[tried])
            shape.due_s[tried] = now + shape.interval_s[tried]

    def choices(self) -> dict[int, int]:
        """{rows bucket: thread count in use} for the shapes seen so far."""
        return {bucket: shape.current for bucket, shape in sorted(self._shapes.items())}


def quota_threads(max_threads: int) -> int:
    """ceil(this cgroup's CPU quota), or max_threads where it has none."""
    quota = cgroup_cpu_quota()
    return max_threads if quota is None else math.ceil(quota)


def adapter_from_env(max_threads: int) -> ThreadAdapter | None:
    """A ThreadAdapter for `max_threads` capped by the cgroup's CPU quota as it is now, or None
    where `KVPILOT_ADAPTIVE_THREADS=0` or there is one thread. Raises ValueError for a value
    other than 0 or 1."""
    value = os.environ.get(ADAPTIVE_ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{ADAPTIVE_ENV}={value!r}: use 1 (adapt the decode steps' thread count, the default) or 0")
    if value == "0" or max_threads <= 1:
        return None
    return ThreadAdapter(max_threads, cap=lambda: quota_threads(max_threads))
