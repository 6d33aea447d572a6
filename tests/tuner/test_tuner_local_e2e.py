"""The tuner against the real engine (`kvpilot serve` with SmolLM2) and a real Prometheus:
live reconfiguration under load, the two measurement sources agreeing on one window, a
3-trial local tuning session, and a start failure classified from the engine's own error.
One engine process (restarted once by the tuning test) keeps the module short; the
sampler's choices are covered by the synthetic-engine tests, so the trials here are
enqueued to exercise every path (unchanged, live, restart). A trial over two nodes runs them
as two processes here (a pipeline stage each) and a node killed during the next trial ends it."""
from __future__ import annotations

import math
import threading
import time

import httpx
import optuna
import pytest
from prometheus_harness import Prometheus

from kvpilot.loadgen.datasets import SampleRequest
from kvpilot.loadgen.process import free_port
from kvpilot.loadgen.tokenizers import load_tokenizer
from kvpilot.engine.exit_codes import EXIT_ENGINE_DIED
from kvpilot.tuner.report import tuning_report as report
from kvpilot.tuner.local.engine_process import EngineProcess
from kvpilot.tuner.failures import OUT_OF_MEMORY, TRANSIENT, TrialFailed
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.local.runner import LocalRunner
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO
from kvpilot.tuner.measure.promql import PrometheusSource
from kvpilot.tuner.measure.scrape import ScrapeSource
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.measure.window import EmptySeries
from kvpilot.tuner.measure.workload import Load, Workload, drive, load_requests

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
# 48 blocks of 16 tokens (768) and up to 8 sequences: a burst of ShareGPT requests preempts.
BASE = EngineSettings(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512)
EXTRA = ["--num-gpu-blocks-override", "48", "--disable-log-requests"]
API_KEY = "tuner-test-key"
WORKLOAD = Workload(num_requests=8, max_prompt_len=96, max_output_len=40, warmup_requests=1, seed=3)
SLOS = SLO(ttft_p95_ms=60_000, itl_p95_ms=5_000, max_preemptions_per_min=1_000)  # loose: every trial counts


@pytest.fixture(scope="module")
def load():
    return load_requests(load_tokenizer(MODEL), WORKLOAD, BASE.max_model_len)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    proc = EngineProcess(MODEL, tmp_path_factory.mktemp("engine") / "engine.log", EXTRA, API_KEY, port=free_port())
    proc.start(BASE)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def prometheus(engine, tmp_path_factory):
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{engine.port}")
    try:
        prom.wait_for('vllm:num_requests_running{job="engine"}')
        yield prom
    finally:
        prom.stop()


def scrape(engine) -> ScrapeSource:
    return ScrapeSource(engine.base_url, {"model_name": MODEL})


def test_live_change_under_load_loses_no_request_and_takes_effect(engine, load):
    assert engine.apply_live({"max_num_seqs": 4})
    requests = (load.requests[1:] * 2)[:10]  # 4 run, the rest wait
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(r=drive(requests, WORKLOAD, engine.base_url, MODEL,
                                                                  engine.headers)))
    worker.start()
    deadline = time.monotonic() + 60
    while scrape(engine).snapshot().in_flight < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.apply_live({"max_num_seqs": 2, "max_num_batched_tokens": 128})
    samples = []  # (running, waiting) while the load runs
    while worker.is_alive():
        gauges = scrape(engine).snapshot().gauges
        samples.append((gauges.get("vllm:num_requests_running", 0), gauges.get("vllm:num_requests_waiting", 0)))
        time.sleep(0.2)
    worker.join()
    results, _ = done["r"]
    assert [r.error for r in results if not r.success] == []
    assert all(r.output_tokens == q.expected_output_len for r, q in zip(results, requests))
    # running requests finish under the old limit; from then on no more than 2 run, while
    # requests still wait (the new limit governs admission)
    settled = next(i for i, (running, _) in enumerate(samples) if running <= 2)
    after = samples[settled:]
    assert max(running for running, _ in after) <= 2
    assert any(waiting > 0 for _, waiting in after)
    info = scrape(engine).snapshot().config_info
    assert (info["max_num_seqs"], info["max_num_batched_tokens"]) == ("2", "128")
    # the engine refuses a live change that breaks its rules, and nothing changes
    with pytest.raises(TrialFailed, match="refused"):
        engine.apply_live({"max_num_seqs": 256, "max_num_batched_tokens": 128})
    assert scrape(engine).snapshot().config_info["max_num_seqs"] == "2"
    assert engine.apply_live({"max_num_seqs": BASE.max_num_seqs, "max_num_batched_tokens": BASE.max_num_batched_tokens})


def test_scrape_and_prometheus_sources_agree_on_the_same_window(engine, prometheus, load):
    scraper = scrape(engine)
    promql = PrometheusSource(prometheus.url, f'job="engine",model_name="{MODEL}"')
    slo = SLO(ttft_p95_ms=2000, itl_p95_ms=300)
    start_scrape, start_prom = scraper.begin(), promql.begin()
    # 8 x (81 + 40) tokens > the 768 KV slots: some requests are preempted
    burst = [SampleRequest(f"{i} " + " ".join(["word"] * 80), 81, 40) for i in range(8)]
    results, _ = drive(burst, WORKLOAD, engine.base_url, MODEL, engine.headers)
    assert all(r.success for r in results)
    by_scrape, by_prom = scraper.measure(start_scrape, slo), promql.measure(start_prom, slo)
    assert by_scrape.completed == by_prom.completed == len(results)
    assert by_scrape.preemptions == by_prom.preemptions > 0
    for name in ("ttft_p95_s", "itl_p95_s", "tpot_p95_s", "e2e_p95_s"):
        a, b = getattr(by_scrape, name), getattr(by_prom, name)
        assert not math.isnan(a) and a == pytest.approx(b, rel=1e-6), name
    # goodput is a rate: the two windows differ in length (Prometheus's edges are scrapes),
    # the share of requests meeting the SLOs does not
    assert by_scrape.goodput_rps * by_scrape.duration_s == pytest.approx(by_prom.goodput_rps * by_prom.duration_s)


def test_a_wrong_selector_is_a_measurement_error_never_zero(engine, prometheus, load):
    """An empty PromQL result or a /metrics page without the selected series voids the
    window (EmptySeries), and the trial fails with the reason after one re-measurement."""
    wrong = PrometheusSource(prometheus.url, 'job="engine",model_name="no-such-model"', scrape_timeout_s=3)
    right = PrometheusSource(prometheus.url, f'job="engine",model_name="{MODEL}"', scrape_timeout_s=10)
    start = right.begin().time_s
    with pytest.raises(EmptySeries, match="no-such-model"):
        wrong.begin()
    with pytest.raises(EmptySeries, match="no series"):
        wrong.counter_delta("vllm:num_preemptions_total", start - 5, start)
    assert right.counter_delta("vllm:num_preemptions_total", start - 5, start) >= 0  # the series exists
    with pytest.raises(EmptySeries, match="no-such-model"):
        ScrapeSource(engine.base_url, {"model_name": "no-such-model"}).snapshot()

    class Once(LocalRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0

        def run_trial(self, number, settings):
            self.calls += 1
            return super().run_trial(number, settings)

    runner = Once(engine, WORKLOAD, Load(load.requests[:2]), SLOS, MODEL,
                  source_for=lambda _url: PrometheusSource(prometheus.url, 'job="no-such-job"', scrape_timeout_s=3))
    study = open_study("void", None)
    Tuner(study, SearchSpace(max_num_batched_tokens=None, max_num_seqs=None), BASE, resolve_model(MODEL),
          Hardware(device_memory_bytes=1, num_gpu_blocks_override=48), SLOS, runner,
          TunerConfig(n_trials=1, remeasure_top=0)).run()
    trial = study.trials[0]
    assert runner.calls == 2 and trial.state == optuna.trial.TrialState.FAIL
    assert "no series" in trial.user_attrs["failure_message"] and trial.user_attrs["verdict"] == "failed"


def test_local_tuning_session_runs_three_trials_live_and_by_restart(engine, prometheus, load, tmp_path):
    workload = Workload(num_requests=4, max_output_len=16, warmup_requests=1)
    short = Load([SampleRequest(r.prompt, r.prompt_len, min(16, r.expected_output_len)) for r in load.requests[:5]])
    runner = LocalRunner(engine, workload, short, SLOS, MODEL,
                         source_for=lambda url: PrometheusSource(prometheus.url, f'job="engine",model_name="{MODEL}"'))
    space = SearchSpace(max_num_batched_tokens=(128, 1024), max_num_seqs=(2, 8), enable_chunked_prefill=(True,),
                        block_size=(16, 32))
    study = open_study("e2e", f"sqlite:///{tmp_path / 'tune.db'}")
    model = resolve_model(MODEL)
    # the defaults, a live change, and a block size that needs a restart (one restart keeps it short)
    study.enqueue_trial(space.params_of(BASE, model), user_attrs={"is_defaults": True})
    study.enqueue_trial({"max_num_batched_tokens": 256, "max_num_seqs": 3, "block_size": 16})
    study.enqueue_trial({"max_num_batched_tokens": 512, "max_num_seqs": 4, "block_size": 32})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    Tuner(study, space, BASE, model, Hardware(1, num_gpu_blocks_override=48), SLOS, runner,
          TunerConfig(n_trials=3, remeasure_top=0)).run()
    rep = report.build(study, SLOS, "goodput")
    assert [t["verdict"] for t in rep["trials"]] == ["measured"] * 3
    for t in rep["trials"]:
        m = t["measurement"]
        assert m["completed"] == workload.num_requests and m["failed"] == 0 and m["source"] == "prometheus"
        assert m["extra"]["reported_config"]["max_num_seqs"] == str(t["settings"]["max_num_seqs"])
        assert m["extra"]["reported_config"]["block_size"] == str(t["settings"]["block_size"])
    assert runner.applied == ["unchanged", "live", "restart"]
    assert rep["trials"][0]["is_defaults"] and rep["best"]["median"] > 0
    assert rep["defaults"]["feasible"] and rep["improvement"]["best_over_defaults"] >= 1.0
    assert "best: trial #" in report.table(rep)


def test_a_binding_slo_the_defaults_break_and_the_tuners_pick_meets(engine, load):
    """No preemptions allowed: a burst of 8 requests of 81 + 24 tokens needs 8 x 7 KV blocks,
    more than the 48 there are, so the defaults (8 sequences at once) preempt whatever the
    machine's speed, while 4 or 2 sequences fit. The tuner samples the rest itself."""
    slo = SLO(ttft_p95_ms=600_000, itl_p95_ms=60_000, max_preemptions_per_min=0)
    burst = Load([SampleRequest(f"{i} " + " ".join(["word"] * 80), 81, 24) for i in range(9)])
    workload = Workload(num_requests=8, warmup_requests=1)
    runner = LocalRunner(engine, workload, burst, slo, MODEL)
    space = SearchSpace(max_num_batched_tokens=None, max_num_seqs=(2, 8), enable_chunked_prefill=(True,),
                        max_num_seqs_pow2=True)
    study = open_study("binding", None, seed=3)
    Tuner(study, space, BASE, resolve_model(MODEL), Hardware(1, num_gpu_blocks_override=48), slo, runner,
          TunerConfig(n_trials=2, remeasure_top=0, max_asks=12)).run()
    rep = report.build(study, slo, "goodput")
    defaults = rep["trials"][0]
    assert defaults["is_defaults"] and defaults["verdict"] == "violates_slo"
    assert defaults["measurement"]["preemptions"] > 0 and "preemptions_per_min" in defaults["violations"]
    best = rep["best"]
    assert best is not None and best["settings"]["max_num_seqs"] < BASE.max_num_seqs
    picked = next(t for t in rep["trials"] if t["number"] == best["number"])
    assert picked["measurement"]["preemptions"] == 0 and picked["measurement"]["failed"] == 0
    assert rep["decision"]["replace"] and rep["decision"]["winner"] == best["number"]


def test_start_failure_is_classified_out_of_memory_as_the_feasibility_check_predicted(tmp_path):
    settings = EngineSettings(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024)
    proc = EngineProcess(MODEL, tmp_path / "engine.log", ["--num-gpu-blocks-override", "16"], startup_timeout_s=120)
    with pytest.raises(TrialFailed) as failure:
        proc.start(settings)
    assert failure.value.kind == OUT_OF_MEMORY and "64 KV blocks" in failure.value.message
    verdict = check(settings, resolve_model(MODEL), Hardware(1, num_gpu_blocks_override=16))
    assert not verdict.feasible and "64 KV blocks" in verdict.reason
    assert not proc.running
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{proc.base_url}/health", timeout=1)


def test_a_trial_over_two_local_nodes_is_measured_and_a_node_killed_in_the_next_ends_it(load, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("KVPILOT_NODE_TIMEOUT_S", "3")
    engine = EngineProcess(MODEL, tmp_path / "engine.log", EXTRA, API_KEY, startup_timeout_s=240)
    runner = LocalRunner(engine, WORKLOAD, load, SLOS, MODEL)
    two_nodes = BASE.replace(pipeline_parallel_size=2, nnodes=2)
    try:
        m = runner.run_trial(0, two_nodes)
        assert (m.completed, m.failed, runner.applied) == (WORKLOAD.num_requests, 0, ["restart"])
        node0, (node1,) = engine.proc, engine.nodes
        node1.kill()  # a worker lost: node 0 fails its requests and exits naming it
        with pytest.raises(TrialFailed) as failed:
            runner.run_trial(1, two_nodes)
        assert failed.value.kind == TRANSIENT
        assert node0.wait(30) == EXIT_ENGINE_DIED
        assert "on node 1" in (tmp_path / "engine.log").read_text()
    finally:
        engine.stop()
    assert not engine.running and engine.nodes == []
