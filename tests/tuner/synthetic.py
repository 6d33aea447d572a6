"""A synthetic engine for tuner tests: a deterministic function from settings to a
measurement, with the shapes of vLLM's tuning guide (more concurrency serves more until
the KV cache runs out and preemptions start; a small token budget slows prefill)."""
from __future__ import annotations

import math

from kvpilot.tuner.failures import TrialFailed
from kvpilot.tuner.search.objective import Measurement
from kvpilot.tuner.search.settings import EngineSettings


class SyntheticRunner:
    """Records every settings it runs. fail: {max_num_seqs: TrialFailed kind} to raise."""

    def __init__(self, fail: dict[int, str] | None = None, preempt_above: int = 48):
        self.calls: list[EngineSettings] = []
        self.fail = fail or {}
        self.preempt_above = preempt_above

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        self.calls.append(settings)
        if settings.max_num_seqs in self.fail:
            raise TrialFailed(self.fail[settings.max_num_seqs], f"synthetic failure for {settings.max_num_seqs}")
        return measure(settings, self.preempt_above)


def measure(s: EngineSettings, preempt_above: int = 48) -> Measurement:
    seqs, budget = s.max_num_seqs, s.max_num_batched_tokens
    throughput = 10 * math.log2(1 + min(seqs, preempt_above)) * min(1.0, budget / 1024)
    ttft = 0.2 + 256 / budget + (0.0 if s.enable_chunked_prefill else 0.3)
    itl = 0.02 + seqs * 0.001 + budget / 50000
    preemptions = max(0, seqs - preempt_above) * 2.0
    return Measurement(duration_s=60, completed=int(throughput * 60), throughput_rps=throughput,
                       goodput_rps=throughput * (1.0 if ttft < 1.0 else 0.5), ttft_p95_s=ttft, itl_p95_s=itl,
                       e2e_p95_s=ttft + 100 * itl, preemptions=preemptions, source="synthetic",
                       extra={"client": {"extra": {"latencies": {"ttft_s": [ttft * k / 10 for k in range(1, 11)],
                                                                 "e2e_s": [(ttft + 100 * itl) * k / 10
                                                                           for k in range(1, 11)]}}}})


class NoisyRunner(SyntheticRunner):
    """The synthetic engine on a shared machine: every window's rates are scaled by the
    next factor of `noise` (cycled), as another job's load would; latencies unchanged.
    gain: {max_num_seqs: factor} makes some settings truly better or worse."""

    def __init__(self, noise: list[float], gain: dict[int, float] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.noise, self.gain, self.windows = list(noise), dict(gain or {}), 0

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        m = super().run_trial(number, settings)
        f = self.noise[self.windows % len(self.noise)] * self.gain.get(settings.max_num_seqs, 1.0)
        self.windows += 1
        m.goodput_rps, m.throughput_rps = m.goodput_rps * f, m.throughput_rps * f
        return m
