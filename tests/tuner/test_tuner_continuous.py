"""The continuous session (kvpilot.tuner.continuous) on a synthetic site whose workload moves
from short to long prompts: the real Tuner, Optuna studies in one storage, the real watcher
and journal seeding; only the engine is the synthetic function of tests/tuner/synthetic.py
with TTFT growing with the prompt length."""
from __future__ import annotations

import math

import optuna
import pytest

from kvpilot.engine.memory import GiB
from kvpilot.tuner.report import tuning_report as reports
from kvpilot.tuner.continuous import ContinuousConfig, run_continuous
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.loop import Tuner, TunerConfig
from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.search.reseed import SEEDED_FROM, prepare, study_names
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.shape import WorkloadShape
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import open_study
from kvpilot.tuner.watch import WatchConfig

SMOL = resolve_model("smollm2-135m-instruct")
SLOS = SLO(ttft_p95_ms=1000, itl_p95_ms=100, max_preemptions_per_min=1000)
SPACE = SearchSpace(max_num_batched_tokens=(256, 4096), max_num_seqs=(8, 64), max_num_seqs_pow2=True,
                    gpu_memory_utilization=None, enable_chunked_prefill=())
BASE = EngineSettings(max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=32)
SHORT = WorkloadShape(duration_s=60, requests=120, arrival_rps=2.0, prompt_tokens_p50=200, prompt_tokens_p90=400,
                      output_tokens_p50=100, output_tokens_p90=128)
LONG = WorkloadShape(duration_s=60, requests=120, arrival_rps=2.0, prompt_tokens_p50=1200, prompt_tokens_p90=1900,
                     output_tokens_p50=100, output_tokens_p90=128)


class World:
    """The traffic: SHORT prompts until window `shift_at`, LONG after. TTFT = 0.2 s + k x 256 /
    budget (k = 1 short, 6 long: long prompts need 6x the prefill), ITL = 30 ms + budget / 40,000
    s, requests/s best at a 1,024-token budget. Short: 512-2,048 meet the SLOs, 1,024 serves
    most; long: only 2,048 does."""

    def __init__(self, shift_at: int):
        self.shift_at, self.windows = shift_at, 0

    @property
    def shape(self) -> WorkloadShape:
        return LONG if self.windows >= self.shift_at else SHORT

    def measure(self, settings: EngineSettings) -> Measurement:
        budget = settings.max_num_batched_tokens
        k = 6 if self.shape is LONG else 1
        ttft, itl = 0.2 + k * 256 / budget, 0.03 + budget / 40000
        rps = 2.0 * min(1.0, budget / 1024) * (1 - 0.05 * abs(math.log2(budget / 1024)))
        ok = ttft < SLOS.ttft_p95_ms / 1000 and itl < SLOS.itl_p95_ms / 1000
        return Measurement(duration_s=60, completed=int(rps * 60), throughput_rps=rps, goodput_rps=rps if ok else 0.0,
                           ttft_p95_s=ttft, itl_p95_s=itl, e2e_p95_s=ttft + 100 * itl, source="synthetic")


class Site:
    """A synthetic Site: studies run the real Tuner on World's current workload."""

    def __init__(self, world: World, storage, base_name: str, pinned=()):
        self.world, self.storage, self.base_name, self.pinned = world, storage, base_name, pinned
        self.running: EngineSettings | None = None
        self.events: list[tuple[str, str]] = []
        self.studies: list[str] = []

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        return self.world.measure(settings)

    def run_study(self, name, running, n_trials):
        study = open_study(name, self.storage, "goodput", "tpe", 0)
        space = SPACE.pin(self.pinned)
        prepare(study, self.storage, self.base_name, running, space, SMOL, self.pinned)
        Tuner(study, space, running, SMOL, Hardware(64 * GiB), SLOS, self,
              TunerConfig(objective="goodput", n_trials=n_trials, remeasure_top=0)).run()
        rep = reports.build(study, SLOS, "goodput")
        replace = rep.get("best") and (rep.get("decision") or {}).get("replace", True)
        self.running = EngineSettings(**rep["best"]["settings"]) if replace else running
        self.studies.append(name)
        return study, self.running

    def observe(self):
        m, shape = self.world.measure(self.running), self.world.shape
        self.world.windows += 1
        return m, shape

    def publish(self, status):
        pass

    def event(self, reason, message, warning=False):
        self.events.append((reason, message))


def session(shift_at=4, windows=12, pinned=(), **watch):
    storage = optuna.storages.InMemoryStorage()
    site = Site(World(shift_at), storage, "s", pinned)
    config = ContinuousConfig(watch=WatchConfig(**{"window_s": 60, "breach_windows": 2, "cooldown_s": 0, **watch}),
                              first_trials=5, retune_trials=4, max_windows=windows)
    clock = iter(range(0, 10**6, 60))
    timeline = run_continuous(site, storage, "s", BASE.replace(max_num_batched_tokens=512), SLOS, config,
                              clock=lambda: float(next(clock)))
    return site, storage, timeline.entries


def test_a_workload_shift_starts_a_seeded_study_and_the_slos_hold_again():
    site, storage, entries = session()
    windows = [e for e in entries if e["kind"] == "window"]
    studies = [e for e in entries if e["kind"] == "study"]
    assert [s["study"] for s in studies] == ["s", "s-1"] and study_names(storage, "s") == ["s", "s-1"]
    assert studies[1]["reason"] in ("SLOBreached", "WorkloadShifted") and site.events[0][0] == studies[1]["reason"]
    assert "prompt_tokens_p50" in site.events[0][1] or "ttft" in site.events[0][1]  # the figures are in the message
    before = [w for w in windows if w["window"] <= 4]
    assert all(w["attainment"] == 1.0 for w in before[1:])  # the first study's winner meets the SLOs on SHORT
    detected = next(w["window"] for w in windows if w["trigger"])
    assert detected - 4 <= 2  # windows to detection: the shift_windows / breach_windows count
    after = [w for w in windows if w["study"] == "s-1"]
    assert after and all(w["attainment"] == 1.0 for w in after)  # re-tuned: the SLOs hold on LONG
    assert site.running.max_num_batched_tokens >= 2048
    retune = optuna.load_study(study_name="s-1", storage=storage)
    first = retune.trials[0]
    assert SEEDED_FROM in first.user_attrs or first.user_attrs.get("is_defaults")  # starts from what it knew
    assert any(t.user_attrs.get("is_defaults") for t in retune.trials)  # the running settings as the baseline
    assert retune.user_attrs["workload_shape"]["prompt_tokens_p50"] == 1200


def test_unchanged_traffic_starts_no_study_over_an_hour_of_windows():
    site, storage, entries = session(shift_at=10**9, windows=60)
    assert [e["study"] for e in entries if e["kind"] == "study"] == ["s"] and not site.events


def test_guard_rails_hold_back_studies_past_the_cap_and_within_the_cool_down():
    # pinned budget: no study can mend the long prompts, so the breach goes on and on
    site, storage, entries = session(shift_at=3, windows=20, pinned=("max_num_batched_tokens",),
                                     max_studies_per_hour=1)
    assert [e["study"] for e in entries if e["kind"] == "study"] == ["s", "s-1"]
    held = [e["held"] for e in entries if e["kind"] == "window" and e["held"]]
    assert held and "cap" in held[0]
    site, storage, entries = session(shift_at=3, windows=10, pinned=("max_num_batched_tokens",), cooldown_s=3600)
    held = [e["held"] for e in entries if e["kind"] == "window" and e["held"]]
    assert held and "cool" in held[0].lower()
    assert [e["study"] for e in entries if e["kind"] == "study"] == ["s"]


def test_pinned_settings_never_change():
    site, storage, entries = session(pinned=("max_num_batched_tokens",))
    for name in study_names(storage, "s"):
        for t in optuna.load_study(study_name=name, storage=storage).trials:
            assert t.user_attrs["settings"]["max_num_batched_tokens"] == 512
    assert site.running.max_num_batched_tokens == 512
    windows = [e for e in entries if e["kind"] == "window"]
    assert any(w["attainment"] == 0.0 for w in windows if w["window"] > 4)  # so the SLOs stay broken, as pinned
    assert not math.isnan(windows[0]["attainment"])


def test_pinning_a_setting_the_tuner_does_not_search_is_refused():
    with pytest.raises(ValueError, match="cannot pin"):
        SPACE.pin(("max_model_len",))


class FakeKube:
    """An InferenceService's status, a resourceVersion, and merge patches that are refused
    (409) when they carry an older resourceVersion, as the API server does."""

    def __init__(self):
        self.obj = {"metadata": {"resourceVersion": "1", "generation": 3},
                    "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}]}}
        self.patches = 0

    def get_isvc(self, namespace, name):
        import copy
        return copy.deepcopy(self.obj)

    def patch(self, path, body):
        from kvpilot.api.kube import ApiError
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        self.obj["status"].update(body["status"])
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
        self.patches += 1


def test_the_tuning_condition_keeps_the_operators_and_is_set_again_when_overwritten():
    from types import SimpleNamespace

    from kvpilot.tuner.cluster.continuous import ClusterSite

    kube = FakeKube()
    studies = SimpleNamespace(kube=kube, a=SimpleNamespace(namespace="ns", name="x"),
                              spec=SimpleNamespace(tuning=SimpleNamespace(watchSeconds=10)),
                              runner=SimpleNamespace(write_tuning=lambda **f: None), event=lambda *a: None)
    site = ClusterSite(studies, stop=lambda: False)
    site.event("WorkloadShifted", "prompt_tokens_p50 35 -> 350 (x10)", warning=True)
    conds = {c["type"]: c for c in kube.obj["status"]["conditions"]}
    assert conds["Ready"]["status"] == "True"  # the operator's condition is kept
    assert (conds["Tuning"]["status"], conds["Tuning"]["reason"]) == ("True", "WorkloadShifted")
    assert conds["Tuning"]["observedGeneration"] == 3
    kube.obj["status"]["conditions"] = [conds["Ready"], {**conds["Tuning"], "reason": "Old"}]  # a stale write-back
    site.publish({"phase": "Watching"})
    assert {c["type"]: c for c in kube.obj["status"]["conditions"]}["Tuning"]["reason"] == "WorkloadShifted"
    before = kube.patches
    site.publish({"phase": "Watching"})
    assert kube.patches == before  # nothing to mend: no write


def test_a_space_pinned_to_one_point_ends_the_study_instead_of_asking_on():
    study = open_study("p", None, "goodput", "tpe", 0)
    world = World(shift_at=10**9)
    site = Site(world, None, "p")
    space = SPACE.pin(("max_num_batched_tokens", "max_num_seqs"))
    Tuner(study, space, BASE, SMOL, Hardware(64 * GiB), SLOS, site,
          TunerConfig(objective="goodput", n_trials=5, remeasure_top=0)).run()
    verdicts = [t.user_attrs["verdict"] for t in study.trials]
    assert verdicts[0] == "measured" and set(verdicts[1:]) == {"duplicate"}
    assert len(verdicts) == 1 + TunerConfig().max_free_asks  # not max_asks (200)


def test_a_watch_window_grows_until_it_holds_enough_requests():
    from kvpilot.tuner.continuous import MAX_WINDOW_GROWTH, watch_window

    class Source:
        """An overloaded engine: 4 requests finish per window_s."""

        def __init__(self):
            self.reads = 0

        def begin(self):
            return None

        def observe_window(self, start, slo):
            self.reads += 1
            return Measurement(duration_s=self.reads, completed=4 * self.reads, ttft_p95_s=60.0), SHORT

    source = Source()
    m, _ = watch_window(source, SLOS, 0.01, min_requests=10)
    assert source.reads == 3 and m.completed == 12  # judged: a fixed window of 4 requests would not be
    idle = Source()
    idle.observe_window = lambda start, slo: (Measurement(duration_s=1, completed=0), SHORT)
    calls = []
    watch_window(idle, SLOS, 0.01, min_requests=10, stop=lambda: calls.append(1) and False)
    assert len(calls) >= MAX_WINDOW_GROWTH  # gives up after MAX_WINDOW_GROWTH windows
