"""The tuning benchmark's scenarios: a load, a KV cache and a grid of scheduler limits each,
where the engine defaults (max_num_seqs 256, max_num_batched_tokens 2048, chunked prefill on)
are meant to be the wrong choice, plus a two-point `quick` one for tests and a first look.

- preempt: a small KV cache and a burst of short ShareGPT requests: many sequences at once
  preempt each other (SLO: no preemption, p95 TTFT and ITL at the 90th percentile of the grid);
- ttft: 100-200-token prompts at a Poisson rate: the budget and the concurrency cap decide how
  long a prompt waits for its first token (p95 TTFT at the grid's median);
- itl: 300-450-token prompts arriving while others decode (p95 ITL at the grid's median).
Every request asks for exactly `output_len` tokens (ignore_eos), so every point serves the same
work. A scenario's JSON form (`spec`) keeps the keys the recorded grids use (kv_blocks,
requests, rate as text).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.workload import Load

AXES = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")
SLO_LIMITS = ("ttft_p95_ms", "itl_p95_ms")
SHAREGPT_POOL = 4000  # most ShareGPT conversations sampled before the prompt-length filter
SHAREGPT_SEED, ARRIVAL_SEED = 1, 7  # fixed: every point and repeat sees the same requests and arrivals


@dataclass(frozen=True)
class Scenario:
    """max_model_len: tokens; kv_blocks: the engine's --num-gpu-blocks-override; requests per
    window (one warm-up request runs before it); rate: requests/s (inf: all at once);
    prompt_len: (low, high) tokens of the ShareGPT prompts taken; output_len: tokens per reply;
    axes: setting -> the grid's values (settings not on an axis keep the engine defaults);
    slo_percentiles: SLO limit -> the percentile of the points' median p95s it is set at;
    no_preemption: the SLO allows no preemption (else preemptions are not limited);
    enable_prefix_caching: off in every scenario (the engine's default is on, as vLLM v1's): each
    point replays the same requests, and a cache kept from the warm-up would make them hits
    (the recorded grids were measured with it off).
    Raises ValueError naming the value to change."""

    max_model_len: int
    kv_blocks: int
    requests: int
    rate: float
    prompt_len: tuple[int, int]
    output_len: int
    axes: dict[str, list[Any]] = field(default_factory=dict)
    slo_percentiles: dict[str, float] = field(default_factory=dict)
    no_preemption: bool = False
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        for name, value in (("max_model_len", self.max_model_len), ("num_gpu_blocks_override", self.kv_blocks)):
            if problem := BY_NAME[name].problem(value):
                raise ValueError(f"{BY_NAME[name].flag}: {problem}")
        for name, values in self.axes.items():
            if name not in AXES:
                raise ValueError(f"grid axis {name!r}: choose among {', '.join(AXES)}")
            if not values or (problem := next(filter(None, map(BY_NAME[name].problem, values)), None)):
                raise ValueError(f"{BY_NAME[name].flag} {values}: {problem or 'give at least one value'}")
        if self.requests < 1 or self.output_len < 1 or not self.rate > 0:
            raise ValueError("--num-requests and --output-len must be >= 1 and --request-rate > 0 (inf: a burst)")
        low, high = self.prompt_len
        if not 1 <= low <= high or high + self.output_len > self.max_model_len:
            raise ValueError(f"--prompt-len {low}:{high} with --output-len {self.output_len} must satisfy "
                             f"1 <= LOW <= HIGH and HIGH + output <= {BY_NAME['max_model_len'].flag} "
                             f"{self.max_model_len}")
        if unknown := set(self.slo_percentiles) - set(SLO_LIMITS):
            raise ValueError(f"slo_percentiles {sorted(unknown)}: choose among {', '.join(SLO_LIMITS)}")

    def replace(self, **changes: Any) -> Scenario:
        """A copy with `changes` (field=value) applied (dataclasses.replace; __post_init__ checks it
        again, raising ValueError as the constructor does)."""
        return dataclasses.replace(self, **changes)

    def defaults(self) -> EngineSettings:
        """The engine's own defaults at this max_model_len, prefix caching as the scenario says:
        the point the tuner starts from."""
        return EngineSettings(max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching)

    def points(self) -> list[EngineSettings]:
        """Every combination of the axes' values, the defaults' other settings kept."""
        out = [self.defaults()]
        for name, values in self.axes.items():
            out = [s.replace(**{name: v}) for s in out for v in values]
        return list(dict.fromkeys(out))

    def offsets(self) -> list[float] | None:
        """The window's Poisson arrival times (s; fixed seed), None for a burst."""
        if math.isinf(self.rate):
            return None
        rng, t, out = random.Random(ARRIVAL_SEED), 0.0, []
        for _ in range(self.requests):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out

    def load(self, tokenizer: Any) -> Load:
        """One warm-up request, then the window's: ShareGPT prompts within prompt_len (as
        `tokenizer` counts them: the engine's own /tokenize in the benchmark), each asking for
        output_len tokens. Raises ValueError when too few prompts fit."""
        low, high = self.prompt_len
        size = 64
        while True:  # a sample is a prefix of a larger one: grow it until enough prompts fit
            pool = sample_sharegpt_requests(tokenizer, size, seed=SHAREGPT_SEED, oversample=False)
            fit = [SampleRequest(r.prompt, r.prompt_len, self.output_len) for r in pool if low <= r.prompt_len <= high]
            if len(fit) > self.requests or size >= SHAREGPT_POOL or len(pool) < size:
                break
            size = min(4 * size, SHAREGPT_POOL)
        if len(fit) < self.requests + 1:
            raise ValueError(f"only {len(fit)} ShareGPT prompts have {low}-{high} tokens; need {self.requests + 1}: "
                             f"widen --prompt-len or lower --num-requests")
        offsets = self.offsets()
        return Load(fit[: self.requests + 1], None if offsets is None else [0.0, *offsets])

    def spec(self) -> dict[str, Any]:
        """The JSON form (rate as text: JSON has no infinity)."""
        out = dataclasses.asdict(self)
        out["rate"], out["prompt_len"] = str(self.rate), list(self.prompt_len)
        return out

    @classmethod
    def from_spec(cls, name: str, spec: dict[str, Any]) -> Scenario:
        """A scenario from its JSON form; keys a recorded grid lacks (its SLO rule) come from
        the published scenario of the same name, else the itl rule."""
        known = SCENARIOS.get(name, SCENARIOS["itl"])
        values = {f.name: spec.get(f.name, getattr(known, f.name)) for f in dataclasses.fields(cls)}
        values.update(rate=float(values["rate"]), prompt_len=tuple(values["prompt_len"]))
        return cls(**values)


SCENARIOS: dict[str, Scenario] = {
    "quick": Scenario(max_model_len=256, kv_blocks=16, requests=3, rate=math.inf, prompt_len=(16, 64),
                      output_len=8, axes={"max_num_seqs": [2, 256]}, slo_percentiles={"ttft_p95_ms": 90},
                      no_preemption=True),
    "preempt": Scenario(max_model_len=256, kv_blocks=16, requests=8, rate=math.inf, prompt_len=(16, 96),
                        output_len=16, axes={"max_num_seqs": [1, 2, 3, 4, 6, 8, 16, 256],
                                             "max_num_batched_tokens": [128, 512, 2048]},
                        slo_percentiles={"ttft_p95_ms": 90, "itl_p95_ms": 90}, no_preemption=True),
    "ttft": Scenario(max_model_len=512, kv_blocks=128, requests=6, rate=1.0, prompt_len=(100, 200), output_len=4,
                     axes={"max_num_seqs": [2, 4, 8, 256], "max_num_batched_tokens": [64, 128, 256, 512, 2048]},
                     slo_percentiles={"ttft_p95_ms": 50}),
    "itl": Scenario(max_model_len=512, kv_blocks=256, requests=8, rate=1.5, prompt_len=(300, 450), output_len=32,
                    axes={"enable_chunked_prefill": [True, False], "max_num_seqs": [4, 16, 256],
                          "max_num_batched_tokens": [64, 128, 512, 2048]},
                    slo_percentiles={"itl_p95_ms": 50}),
}
