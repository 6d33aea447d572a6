"""The guided search (`kvpilot.tuner.search.guide`) on small synthetic tables: its first trials
come from the memory model (when the defaults preempted) and from the SLO the defaults
broke (a CPU engine's repair differs from a GPU's), it walks to neighbours of
the best point, it never deploys a setting the memory model refuses, a setting feasible in
only one of two measurements is not chosen, and over seeds with a third of the grid as
budget it lands near the table's best feasible point, better than random search."""
from __future__ import annotations

import math
import random
import statistics

import optuna
import pytest

from kvpilot.tuner.report import tuning_report as report
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.guide import RequestTokens, kv_fit_seqs, kv_fit_settings, neighbours, steps
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO, Measurement, is_feasible, slack
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import make_sampler

optuna.logging.set_verbosity(optuna.logging.WARNING)
SMOL = resolve_model("smollm2-135m-instruct")
BLOCKS = 32  # KV blocks of 16 tokens: 512 tokens
HW = Hardware(device_memory_bytes=1, num_gpu_blocks_override=BLOCKS)
BASE = EngineSettings(max_model_len=256)  # engine defaults: 256 seqs, budget 2048, chunked on
TOKENS = RequestTokens(mean=80, longest=120)  # 6 and 8 blocks per request
SEQS, BUDGETS = [1, 2, 3, 4, 6, 8, 16, 256], [64, 128, 512, 2048]
SLOS = SLO(ttft_p95_ms=3000, itl_p95_ms=300, max_preemptions_per_min=0)


class GridSpace(SearchSpace):
    """The grid's values on each axis (the tuning-quality benchmark's space)."""

    def batched_tokens_choices(self, base):
        return BUDGETS

    def seqs_choices(self, base):
        return SEQS

    def bounds_with(self, base):
        return self


SPACE = GridSpace(max_num_batched_tokens=(64, 2048), max_num_seqs=(1, 256), enable_chunked_prefill=(True,),
                  max_num_seqs_pow2=True)


def engine(s: EngineSettings, noise: float = 1.0) -> Measurement:
    """A preempting engine: more sequences serve more until the KV cache (5 average
    requests) runs out, then preemptions; a small budget slows prefill (TTFT)."""
    fit = BLOCKS * 16 / TOKENS.mean
    rate = math.log2(1 + min(s.max_num_seqs, fit)) * min(1.0, s.max_num_batched_tokens / 512) * noise
    ttft = 1.0 + 128 / s.max_num_batched_tokens
    preempt = 6.0 * max(0.0, s.max_num_seqs - fit)
    return Measurement(duration_s=60, completed=60, throughput_rps=rate, goodput_rps=rate, ttft_p95_s=ttft,
                       itl_p95_s=0.1, preemptions=preempt)


class TableRunner:
    """Each deployment multiplies the rate by a noise factor drawn by the seed (+-10 %)."""

    def __init__(self, seed: int):
        self.rng, self.deployed = random.Random(seed), []

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        self.deployed.append(settings)
        return engine(settings, self.rng.uniform(0.9, 1.1))


class Recorder:
    """Deploys by calling `measure(settings)` and records what it deployed."""

    def __init__(self, measure):
        self.measure, self.deployed = measure, []

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        self.deployed.append(settings)
        return self.measure(settings)


def flat(itl_s: float) -> Measurement:
    """A window serving 1 req/s with p95 ITL `itl_s` and no preemption."""
    return Measurement(duration_s=60, completed=60, throughput_rps=1.0, goodput_rps=1.0, itl_p95_s=itl_s,
                       ttft_p95_s=1.0)


GRID = [BASE.replace(max_num_seqs=q, max_num_batched_tokens=b) for q in SEQS for b in BUDGETS]


def table_best() -> float:
    return max(engine(s).goodput_rps for s in GRID if check(s, SMOL, HW).feasible and is_feasible(slack(engine(s), SLOS)))


def ratio(s: EngineSettings) -> float:
    m = engine(s)
    return m.goodput_rps / table_best() if is_feasible(slack(m, SLOS)) else 0.0


def tune(seed: int, budget: int) -> tuple[EngineSettings, TableRunner, optuna.Study]:
    runner = TableRunner(seed)
    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed))
    Tuner(study, SPACE, BASE, SMOL, HW, SLOS, runner,
          TunerConfig(n_trials=budget - 2, remeasure_top=1, max_asks=60, guided=True, request_tokens=TOKENS)).run()
    rep = report.build(study, SLOS, "goodput")
    chosen = EngineSettings(**rep["best"]["settings"]) if rep["best"] and rep["decision"]["replace"] else BASE
    return chosen, runner, study


def test_the_memory_model_point_is_the_most_sequences_the_kv_cache_holds():
    assert kv_fit_seqs(BLOCKS, 16, TOKENS.longest) == 4 and kv_fit_seqs(BLOCKS, 16, TOKENS.mean) == 6
    points = kv_fit_settings(BASE, SPACE, SMOL, HW, TOKENS)
    assert [p.max_num_seqs for p in points] == [4, 6]
    assert all(p.max_num_batched_tokens == BASE.max_num_batched_tokens for p in points)
    # live traffic (no lengths): a max_model_len sequence per slot, 32 blocks / 16 = 2
    assert [p.max_num_seqs for p in kv_fit_settings(BASE, SPACE, SMOL, HW, None)] == [2]


def test_neighbours_are_one_step_on_one_axis():
    s = BASE.replace(max_num_seqs=4, max_num_batched_tokens=512)
    got = {(n.max_num_seqs, n.max_num_batched_tokens) for n in neighbours(s, SPACE, BASE)}
    assert got == {(3, 512), (6, 512), (4, 128), (4, 2048)}
    # a coarse step, clamped to the ends of an axis
    got = {(n.max_num_seqs, n.max_num_batched_tokens) for n in neighbours(s, SPACE, BASE, step=2)}
    assert got == {(2, 512), (8, 512), (4, 64), (4, 2048)}
    assert steps(SPACE, BASE) == [4, 2, 1]  # 8 max_num_seqs choices


def test_first_trials_are_the_defaults_then_the_memory_model_points_and_no_refused_setting_is_deployed():
    _, runner, study = tune(seed=0, budget=10)
    assert runner.deployed[0] == BASE
    assert [s.max_num_seqs for s in runner.deployed[1:3]] == [4, 6]
    assert all(check(s, SMOL, HW).feasible for s in runner.deployed)
    assert len(runner.deployed) <= 10


def test_a_broken_itl_slo_is_repaired_with_chunked_prefill_and_a_small_budget():
    slo = SLO(ttft_p95_ms=0, itl_p95_ms=100, max_preemptions_per_min=100)

    runner = Recorder(lambda s: flat(s.max_num_batched_tokens / 4000))  # a bigger budget, slower decodes
    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", 0))
    space = SearchSpace(max_num_batched_tokens=(64, 2048), max_num_seqs=None, enable_chunked_prefill=(True, False))
    base = EngineSettings(max_model_len=256, enable_chunked_prefill=False)  # budget 2048, prefills first
    Tuner(study, space, base, SMOL, Hardware(device_memory_bytes=1, num_gpu_blocks_override=512), slo, runner,
          TunerConfig(n_trials=2, remeasure_top=0, guided=True)).run()
    assert runner.deployed[1] == base.replace(enable_chunked_prefill=True, max_num_batched_tokens=256)


def test_on_a_cpu_engine_a_broken_itl_slo_is_repaired_with_prefills_in_steps_of_their_own():
    """A CPU step pays for every token it carries (benchmarks/results/tuning/README.md, itl):
    the repair there is chunked prefill off, the budget raised to max_model_len."""
    slo = SLO(ttft_p95_ms=0, itl_p95_ms=100, max_preemptions_per_min=100)

    space = SearchSpace(max_num_batched_tokens=(64, 2048), max_num_seqs=None, enable_chunked_prefill=(True, False))
    cpu = Hardware(device_memory_bytes=1, num_gpu_blocks_override=512, shared_memory=True)
    for budget, repaired in ((128, 256), (2048, 2048)):  # chunked prefill off needs budget >= max_model_len
        runner = Recorder(lambda s: flat(0.2 if s.enable_chunked_prefill else 0.05))  # chunks slow decodes
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", 0))
        base = EngineSettings(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=budget)
        Tuner(study, space, base, SMOL, cpu, slo, runner, TunerConfig(n_trials=2, remeasure_top=0, guided=True)).run()
        assert runner.deployed[1] == base.replace(enable_chunked_prefill=False, max_num_batched_tokens=repaired)


def test_defaults_that_did_not_preempt_get_no_memory_model_point():
    """vLLM's tuning guide lowers max_num_seqs for preemptions; without any, the second
    trial is a neighbour move, not the memory model's 4 or 6 sequences."""
    runner = Recorder(lambda s: flat(0.1))
    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", 0))
    Tuner(study, SPACE, BASE, SMOL, HW, SLOS, runner,
          TunerConfig(n_trials=3, remeasure_top=0, guided=True, request_tokens=TOKENS)).run()
    assert runner.deployed[0] == BASE
    moves = [t.user_attrs.get("guided_from") for t in study.trials[1:3]]
    assert all(moves), "every trial after the defaults moves from a measured one; memory-model points have no center"
    assert [s.max_num_seqs for s in runner.deployed[1:3]] != [4, 6]
    assert len(runner.deployed) == 3


def test_a_setting_feasible_in_one_of_two_measurements_is_not_chosen():
    class Flaky:
        """seqs 16 preempts in every second window; seqs 2 never does but serves less."""

        def __init__(self):
            self.count: dict[int, int] = {}

        def run_trial(self, number, settings):
            n = self.count[settings.max_num_seqs] = self.count.get(settings.max_num_seqs, 0) + 1
            preempt = 5.0 if settings.max_num_seqs == 16 and n % 2 == 0 else 0.0
            rate = {16: 2.0, 2: 1.0}.get(settings.max_num_seqs, 0.5)
            return Measurement(duration_s=60, completed=60, throughput_rps=rate, goodput_rps=rate,
                               ttft_p95_s=1.0, itl_p95_s=0.1, preemptions=preempt)

    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", 0))
    space = SearchSpace(max_num_batched_tokens=None, max_num_seqs=(2, 16), enable_chunked_prefill=(True,),
                        max_num_seqs_pow2=True)
    base = EngineSettings(max_model_len=256, max_num_seqs=16)
    big = Hardware(device_memory_bytes=1, num_gpu_blocks_override=4096)
    study.enqueue_trial({"max_num_seqs": 2})  # then the defaults, 16
    Tuner(study, space, base, SMOL, big, SLOS, Flaky(),
          TunerConfig(n_trials=2, remeasure_top=2, guided=False)).run()
    rep = report.build(study, SLOS, "goodput")
    assert rep["best"]["settings"]["max_num_seqs"] == 2
    assert {r["feasible_runs"] for r in rep["ranking"]} == {"1/2", "2/2"}


@pytest.mark.parametrize("budget", [11])  # a third of the 32-point grid
def test_over_seeds_the_guided_tuner_lands_near_the_best_and_beats_random_search(budget):
    tuner = [ratio(tune(seed, budget)[0]) for seed in range(8)]
    rand = []
    for seed in range(8):
        rng, runner = random.Random(seed), TableRunner(seed)
        best, best_value = BASE, -1.0
        for s in (rng.choice(GRID) for _ in range(budget)):
            if not check(s, SMOL, HW).feasible:
                continue
            m = runner.run_trial(0, s)
            if is_feasible(slack(m, SLOS)) and m.goodput_rps > best_value:
                best, best_value = s, m.goodput_rps
        rand.append(ratio(best))
    assert statistics.median(tuner) >= 0.95 and min(tuner) >= 0.85
    assert statistics.median(tuner) > statistics.median(rand) or min(tuner) > min(rand)


def test_preempted_defaults_try_the_largest_kv_cache_first_when_the_search_has_it():
    """vLLM's guide's first remedy (more KV cache memory) before its second (fewer sequences):
    with `--kv-cache-memory-bytes LOW:HIGH` searched, the trial after the defaults is the
    defaults with the largest cache; without the axis it is the memory model's 4 sequences."""
    from kvpilot.tuner.search.guide import more_cache_settings

    cache = 24 * 16 * 23040  # 24 blocks of the builtin model's bf16 KV: one max_model_len sequence fits
    base = EngineSettings(max_model_len=256, kv_cache_memory_bytes=cache)
    space = SearchSpace(max_num_batched_tokens=(64, 2048), max_num_seqs=(1, 256), enable_chunked_prefill=(True,),
                        kv_cache_memory_bytes=(cache, 4 * cache))
    assert more_cache_settings(base, space) == [base.replace(kv_cache_memory_bytes=4 * cache)]
    assert more_cache_settings(base, SPACE) == [] and more_cache_settings(BASE, space) == []
    cpu = Hardware(device_memory_bytes=1 << 34, shared_memory=True)

    def preempting(s: EngineSettings) -> Measurement:
        fits = s.kv_cache_memory_bytes // (16 * 23040) // 8  # requests of 8 blocks the cache holds
        return Measurement(duration_s=60, completed=60, throughput_rps=1.0, goodput_rps=1.0, ttft_p95_s=1.0,
                           itl_p95_s=0.1, preemptions=6.0 * max(0, min(s.max_num_seqs, 8) - fits))

    runner = Recorder(preempting)
    study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", 0))
    Tuner(study, space, base, SMOL, cpu, SLOS, runner,
          TunerConfig(n_trials=2, remeasure_top=0, guided=True, request_tokens=RequestTokens(mean=120, longest=120))).run()
    assert runner.deployed[:2] == [base, base.replace(kv_cache_memory_bytes=4 * cache)]
