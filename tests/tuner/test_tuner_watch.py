"""The watch policy after a study (tuner/watch.py): K windows breaking an SLO or a shape
moved past the ratio for consecutive windows start a study; small windows judge nothing;
cool-down and the per-hour cap hold triggers back; unchanged noisy traffic starts nothing."""
from __future__ import annotations

import math
import random

import pytest

from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.measure.shape import WorkloadShape, shape_between
from kvpilot.tuner.watch import SLO_BREACHED, WORKLOAD_SHIFTED, WatchConfig, Watcher
from kvpilot.tuner.measure.window import OUTPUT_TOKENS, PROMPT_TOKENS, REQUESTS, Snapshot

SLOS = SLO(ttft_p95_ms=2000, itl_p95_ms=200)
BASE = WorkloadShape(60.0, 60.0, 1.0, 210.0, 640.0, 120.0, 128.0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def window(ttft_s=0.5, completed=60, failed=0, good_share=1.0) -> Measurement:
    return Measurement(duration_s=60, completed=completed, failed=failed, throughput_rps=completed / 60,
                       goodput_rps=completed / 60 * good_share, ttft_p95_s=ttft_s, itl_p95_s=0.05)


def moved(**figures) -> WorkloadShape:
    return WorkloadShape(**{**BASE.as_dict(), **figures})


def watcher(clock=None, **config) -> Watcher:
    return Watcher(SLOS, WatchConfig(**config), reference=BASE, clock=clock or Clock())


def test_k_consecutive_breaching_windows_trigger_slo_breached_with_the_figures():
    w = watcher(breach_windows=3)
    verdicts = [w.observe(window(ttft_s=5.2, good_share=0.4), BASE) for _ in range(3)]
    assert [v.trigger for v in verdicts[:2]] == [None, None]
    assert [v.breached_windows for v in verdicts] == [1, 2, 3]
    trigger = verdicts[2].trigger
    assert trigger.reason == SLO_BREACHED
    assert trigger.message == "SLOs broken 3 windows in a row: ttft_p95_ms 5200 > 2000"
    assert trigger.figures["violations"] == {"ttft_p95_ms": 3200.0} and trigger.figures["windows"] == 3
    assert verdicts[2].attainment == pytest.approx(0.4) and verdicts[2].violations == {"ttft_p95_ms": 3200.0}


def test_a_good_window_resets_the_breach_count():
    w = watcher(breach_windows=3)
    for _ in range(2):
        w.observe(window(ttft_s=5.0), BASE)
    assert w.observe(window(), BASE).breached_windows == 0
    assert [w.observe(window(ttft_s=5.0), BASE).trigger for _ in range(2)] == [None, None]


def test_a_window_with_few_requests_judges_nothing_and_keeps_the_counts():
    w = watcher(breach_windows=3, min_requests=10)
    w.observe(window(ttft_s=5.0), BASE)
    w.observe(window(ttft_s=5.0), BASE)
    quiet = w.observe(window(ttft_s=9.0, completed=3), moved(prompt_tokens_p50=5000, requests=3))
    assert quiet.violations == {} and quiet.shift == {} and quiet.trigger is None
    assert quiet.breached_windows == 2 and quiet.attainment == pytest.approx(1.0)
    assert w.observe(window(ttft_s=5.0), BASE).trigger.reason == SLO_BREACHED


def test_a_window_where_every_request_fails_is_a_breach_not_an_empty_window():
    w = watcher(breach_windows=1)
    v = w.observe(window(ttft_s=math.nan, completed=0, failed=40), moved(requests=0, arrival_rps=0))
    assert math.isnan(v.attainment)
    assert v.trigger.reason == SLO_BREACHED and "ttft_p95_ms: no samples" in v.trigger.message
    assert "failed_requests 40 > 0" in v.trigger.message


def test_a_shift_needs_shift_windows_consecutive_windows():
    w = watcher(shift_windows=2)
    long_prompts = moved(prompt_tokens_p50=880.0, prompt_tokens_p90=2000.0)
    first = w.observe(window(), long_prompts)
    assert first.shift == {"prompt_tokens_p50": (210.0, 880.0), "prompt_tokens_p90": (640.0, 2000.0)}
    assert first.trigger is None and first.shifted_windows == 1
    assert w.observe(window(), BASE).shifted_windows == 0  # back to the tuned-on shape: reset
    w.observe(window(), long_prompts)
    trigger = w.observe(window(), long_prompts).trigger
    assert trigger.reason == WORKLOAD_SHIFTED
    assert trigger.message.startswith("workload shifted for 2 windows: prompt_tokens_p50 210 -> 880 (x4.2)")
    assert trigger.figures["shifted"]["prompt_tokens_p50"] == [210.0, 880.0]
    assert trigger.figures["reference"]["prompt_tokens_p50"] == 210.0


def test_a_breach_wins_over_a_shift_in_the_same_window():
    w = watcher(breach_windows=1, shift_windows=1)
    v = w.observe(window(ttft_s=4.0), moved(arrival_rps=5.0))
    assert v.trigger.reason == SLO_BREACHED and v.shifted_windows == 1


def test_without_a_reference_the_first_judged_window_becomes_it():
    w = Watcher(SLOS, WatchConfig(shift_windows=1, reference_windows=1), clock=Clock())
    w.observe(window(completed=2), moved(prompt_tokens_p50=50.0, requests=2))  # too small: not the reference
    assert w.observe(window(), BASE).trigger is None and w.reference == BASE
    assert w.observe(window(), moved(arrival_rps=3.0)).trigger.reason == WORKLOAD_SHIFTED


def test_the_reference_is_the_median_of_several_windows_and_rebuilt_after_a_study():
    w = Watcher(SLOS, WatchConfig(shift_windows=1, reference_windows=3), clock=Clock())
    odd = moved(prompt_tokens_p90=BASE.prompt_tokens_p90 * 5)  # one odd window among three
    for shape in (BASE, odd, BASE):
        assert w.observe(window(), shape).trigger is None  # no shift is judged while the reference builds
    assert w.reference.prompt_tokens_p90 == BASE.prompt_tokens_p90 and w.reference.requests == 3 * BASE.requests
    assert w.observe(window(), moved(arrival_rps=3.0)).trigger.reason == WORKLOAD_SHIFTED
    w.rebuild_reference()
    assert w.reference is None
    for _ in range(3):
        w.observe(window(), moved(arrival_rps=3.0))
    assert w.reference.arrival_rps == 3.0
    with pytest.raises(ValueError, match="reference_windows"):
        WatchConfig(reference_windows=0)


def test_unchanged_noisy_traffic_starts_no_study_over_two_hours():
    rng = random.Random(50)
    w = watcher()
    for _ in range(120):
        noisy = moved(**{f: getattr(BASE, f) * rng.uniform(0.7, 1.3) for f in
                         ("arrival_rps", "prompt_tokens_p50", "prompt_tokens_p90", "output_tokens_p50",
                          "output_tokens_p90")})
        v = w.observe(window(ttft_s=rng.uniform(0.3, 1.9)), noisy)
        assert v.trigger is None and v.held is None and v.shift == {}


def cumulative(lengths, bounds=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, math.inf)) -> dict[float, float]:
    return {b: float(sum(1 for n in lengths if n <= b)) for b in bounds}


def sampled_windows(rng, count, rps, prompt_median, output_max=128, start=None):
    """Windows of Poisson arrivals with log-normal prompt lengths (sigma 0.8) and outputs
    up to output_max, through 1-2-5 buckets and shape_between as the sources compute them."""
    prompts, outputs = [], []
    snap = start or Snapshot(time_s=0.0, counters={REQUESTS: 0.0})
    for _ in range(count):
        arrivals, clock = 0, rng.expovariate(rps)
        while clock < 60:
            arrivals, clock = arrivals + 1, clock + rng.expovariate(rps)
        prompts += [min(2048, round(rng.lognormvariate(math.log(prompt_median), 0.8))) for _ in range(arrivals)]
        outputs += [min(output_max, round(rng.uniform(0.3, 1.0) * output_max)) for _ in range(arrivals)]
        end = Snapshot(time_s=snap.time_s + 60, counters={REQUESTS: float(len(prompts))},
                       buckets={PROMPT_TOKENS: cumulative(prompts), OUTPUT_TOKENS: cumulative(outputs)})
        yield shape_between(snap, end), arrivals
        snap = end


def test_sampled_traffic_through_the_buckets_starts_nothing_until_the_prompts_grow():
    """An hour of 1 req/s with the same length distributions starts no study; prompts four
    times longer are seen within shift_windows windows."""
    rng, w = random.Random(7), watcher(shift_windows=2)
    w.reference = None
    for s, arrivals in sampled_windows(rng, 60, rps=1.0, prompt_median=200):
        v = w.observe(window(completed=arrivals), s)
        assert v.trigger is None, (v.shift, s.describe())
    verdicts = [w.observe(window(completed=arrivals), s)
                for s, arrivals in sampled_windows(rng, 2, rps=1.0, prompt_median=800)]
    assert verdicts[-1].trigger is not None and verdicts[-1].trigger.reason == WORKLOAD_SHIFTED
    assert "prompt_tokens_p50" in verdicts[-1].shift


def test_cool_down_holds_a_trigger_back_and_then_releases_it():
    clock = Clock()
    w = watcher(clock, breach_windows=2, cooldown_s=600)
    w.study_started()
    assert w.observe(window(ttft_s=5.0), BASE).held is None  # counts, nothing to hold yet
    assert w.observe(window(ttft_s=5.0), BASE).held == "SLOBreached held back by a study running"
    clock.now += 300
    w.study_ended(moved(arrival_rps=2.0))
    assert w.reference.arrival_rps == 2.0 and w.breached_windows == 0
    clock.now += 60
    w.observe(window(ttft_s=5.0), moved(arrival_rps=2.0))
    v = w.observe(window(ttft_s=5.0), moved(arrival_rps=2.0))
    assert v.trigger is None and v.held == "SLOBreached held back by cool-down: 540 s left"
    clock.now += 540
    v = w.observe(window(ttft_s=5.0), moved(arrival_rps=2.0))
    assert v.trigger.reason == SLO_BREACHED and v.breached_windows == 3 and v.held is None


def test_at_most_max_studies_per_hour_over_a_sliding_hour():
    clock = Clock()
    w = watcher(clock, breach_windows=1, cooldown_s=0, max_studies_per_hour=2)
    for _ in range(2):
        assert w.observe(window(ttft_s=5.0), BASE).trigger is not None
        w.study_started()
        clock.now += 600
        w.study_ended(None)
    v = w.observe(window(ttft_s=5.0), BASE)
    assert v.trigger is None and v.held == "SLOBreached held back by cap: 2 studies in the last hour (next in 2400 s)"
    assert w.reference == BASE  # None keeps the old reference
    clock.now += 2400
    assert w.observe(window(ttft_s=5.0), BASE).trigger.reason == SLO_BREACHED


@pytest.mark.parametrize("bad, message", [
    ({"shift_ratio": 1.0}, "shift_ratio must be > 1"),
    ({"breach_windows": 0}, "breach_windows and shift_windows must be >= 1"),
    ({"window_s": 0}, "window_s must be > 0"),
    ({"cooldown_s": -1}, "cooldown_s >= 0"),
])
def test_config_that_cannot_work_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        WatchConfig(**bad)
