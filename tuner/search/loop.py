"""The tuning loop, ask-and-tell: ask Optuna for a trial, turn it into engine settings,
check feasibility, run it on a runner (local processes or a cluster), tell the result.

Every outcome that says something about the settings reaches the sampler. Optuna's TPE
conditions only on COMPLETE and PRUNED trials, its GPSampler only on COMPLETE ones, and
both rank infeasible trials by their constraint values (`Trial.set_constraint`); a FAIL
trial is invisible to both (optuna/samplers/_tpe/sampler.py `_sample`,
_gp/sampler.py `sample_relative`). So every trial with a verdict about its settings is
told COMPLETE, with constraint values in Optuna's contract (> 0 violated):
- measured: its objective value(s) and SLO slack;
- infeasible (the memory model refused it, never deployed) and failed (OOM, crash,
  refused flags; transient failures are retried once first): a dominated objective
  value (`penalty_values`) and, on every constraint, a violation as large as the worst
  one measured so far (`penalty_constraints`), so both samplers rank it last without
  an outlier that would swamp the GP's standardisation;
- cut short (a live-traffic trial that clearly broke an SLO): its partial measurement's values and slack;
- settings measured before: the earlier result ('duplicate', not re-run).
The real outcome stays visible in the user attributes: `verdict`, `pruned_reason`,
`failure_kind`, `failure_message`, `measurement`. Only a failure that says nothing about
the settings is told FAIL: a transient one after its retry, and a trial interrupted by a
killed tuner (`kvpilot.tuner.search.study.recover_interrupted`); both may be proposed again.
The engine defaults are enqueued as the first trial; with `guided` (`kvpilot tune`'s
default) the next trials come from `kvpilot.tuner.search.guide` (memory-model points, a repair of
the SLO the defaults broke, neighbour moves from the best so far) and the sampler proposes
when the guide has nothing left. At the end the best few feasible trials (and the incumbent,
the defaults, when feasible) are measured again; the report's decision (`kvpilot.tuner.search.decision`)
replaces the running settings only when the winner beats the incumbent beyond the measured spread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from kvpilot.engine.config import ModelConfig
from kvpilot.tuner.search import feasibility
from kvpilot.tuner.search.decision import relative_spread, window_figure
from kvpilot.tuner.failures import TRANSIENT, TrialCutShort, TrialFailed
from kvpilot.tuner.search.guide import Guide, RequestTokens
from kvpilot.tuner.search.objective import (CONSTRAINTS_ATTR, INFEASIBLE, SLO, Measurement, constraint_names, is_feasible,
                                     slack, values)
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import NATIVE_CONSTRAINTS, recover_interrupted

logger = logging.getLogger("kvpilot.tuner")

MEASURED, VIOLATES, PRUNED, FAILED, DUPLICATE, KNOWN_FAILURE, CUT_SHORT = (
    "measured", "violates_slo", "pruned", "failed", "duplicate", "known_failure", "cut_short")


class TuningStopped(Exception):
    """The tuner was asked to stop (e.g. the operator shuts down); the study resumes later."""


class Runner(Protocol):
    """Where trials run: local engine processes (LocalRunner) or an InferenceService (KubernetesRunner)."""

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        """Deploys `settings` as trial `number`, drives or observes load, returns the window's Measurement.
        Raises TrialFailed (classified) when the settings cannot run, TrialCutShort on a clear SLO breach."""


@dataclass(frozen=True)
class TunerConfig:
    """objective: 'goodput' | 'throughput' | 'multi'; latency: the p95 that 'multi' minimises ('ttft' | 'itl' | 'e2e');
    n_trials: deployments to spend (measured or failed trials; pruned and duplicate ones are free);
    remeasure_top: how many of the best feasible trials to measure again at the end (the incumbent, trial 0, too
    when it is feasible); max_asks: stop after this many asks even if the budget is not spent (a space that is
    mostly infeasible); max_free_asks: stop after this many asks in a row that deploy nothing (duplicates,
    refusals: a space with nothing new left, e.g. pinned); max_windows: windows per trial, more than one
    measures a second and keeps going up to max_windows while their relative spread exceeds wide_spread
    (`kvpilot.tuner.search.decision.window_figure`); guided: propose trials with `kvpilot.tuner.search.guide` before the
    sampler; request_tokens: the workload's request sizes (prompt + output tokens) the guide's memory-model
    points use (None: max_model_len)."""

    objective: str = "goodput"
    latency: str = "e2e"
    n_trials: int = 8
    remeasure_top: int = 2
    max_asks: int = 200
    max_free_asks: int = 30
    max_windows: int = 1
    wide_spread: float = 0.15
    guided: bool = False
    request_tokens: RequestTokens | None = None


class Tuner:
    """The ask-and-tell loop of the module docstring over one study; `run` spends the budget of `config`."""

    def __init__(self, study: optuna.Study, space: SearchSpace, base: EngineSettings, model: ModelConfig,
                 hardware: feasibility.Hardware, slo: SLO, runner: Runner, config: TunerConfig = TunerConfig(),
                 on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None):
        self.study, self.base, self.model, self.hardware = study, base, model, hardware
        self.space = space.bounds_with(base)
        if self.space != space:
            logger.warning("search bounds widened to include the engine defaults (trial 0): %s", self.space)
        self.slo, self.runner, self.config = slo, runner, config
        self.on_trial = on_trial or (lambda _t: None)
        self.n_constraints = len(constraint_names(slo))
        self.guide = Guide(self.space, base, model, hardware, slo, config.request_tokens, seed=len(study.trials)) \
            if config.guided else None

    # ------------------------------------------------------------ driver
    def run(self, stop: Callable[[], bool] = lambda: False) -> optuna.Study:
        """Spends the trial budget (continuing a resumed study), then re-measures the best.
        `stop()` is checked before each trial; when it turns true the run raises
        TuningStopped (the study keeps every finished trial and resumes later)."""
        interrupted = recover_interrupted(self.study)
        if interrupted:
            logger.info("resuming: trials %s were interrupted and are queued again", interrupted)
        if not any(t.user_attrs.get("is_defaults") for t in self.study.get_trials(deepcopy=False)):
            self.study.enqueue_trial(self.space.params_of(self.base, self.model), user_attrs={"is_defaults": True})
        asks = free = 0
        while self.deployed() < self.config.n_trials and asks < self.config.max_asks:
            if stop():
                raise TuningStopped(f"stopped after {self.deployed()} of {self.config.n_trials} trials")
            asks += 1
            free = free + 1 if self.step().user_attrs.get("verdict") in (DUPLICATE, PRUNED, KNOWN_FAILURE) else 0
            if free >= self.config.max_free_asks:  # e.g. a space pinned down to a point or two
                logger.warning("stopping: %d asks in a row deployed nothing new (the space is spent)", free)
                break
        if self.config.objective != "multi":
            self.remeasure_best(stop)
        return self.study

    def deployed(self) -> int:
        """Trials that deployed settings (measured or failed), re-measurements not counted."""
        return sum(1 for t in self.study.get_trials(deepcopy=False) if "remeasure_of" not in t.user_attrs
                   and t.user_attrs.get("verdict") in (MEASURED, VIOLATES, FAILED, CUT_SHORT))

    def step(self) -> optuna.trial.FrozenTrial:
        """One ask (the guide's proposal when it has one), judge, (maybe) run, tell."""
        if self.guide is not None and not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            proposal = self.guide.propose(self.study)
            if proposal is not None:
                attrs = {"guided": True, **({"guided_from": self.guide.center} if self.guide.center else {})}
                self.study.enqueue_trial(self.space.params_of(proposal, self.model), user_attrs=attrs)
        trial = self.study.ask()
        settings = self.space.suggest(trial, self.base, self.model)
        trial.set_user_attr("settings", settings.as_dict())
        if "remeasure_of" not in trial.user_attrs:
            prior = self.find_prior(settings, trial.number)
            if prior is not None:
                return self._tell_prior(trial, prior)
        verdict = feasibility.check(settings, self.model, self.hardware)
        trial.set_user_attr("predicted_kv_blocks", verdict.num_blocks)
        if not verdict.feasible:
            logger.info("trial %d pruned: %s", trial.number, verdict.reason)
            trial.set_user_attr("pruned_reason", verdict.reason)
            return self._tell(trial, PRUNED)
        return self._run(trial, settings)

    # ------------------------------------------------------------ outcomes
    def _run(self, trial: optuna.Trial, settings: EngineSettings) -> optuna.trial.FrozenTrial:
        for attempt in (1, 2):
            try:
                m, figures = window_figure(lambda: self.runner.run_trial(trial.number, settings), self._figure,
                                           self.config.max_windows, self.config.wide_spread)
                break
            except TrialCutShort as e:
                trial.set_user_attr("measurement", e.measurement.as_dict())
                trial.set_user_attr("pruned_reason", e.reason)
                return self._tell(trial, CUT_SHORT, constraints=slack(e.measurement, self.slo),
                                  values=values(e.measurement, self.config.objective, self.config.latency))
            except TrialFailed as e:
                if e.retryable and attempt == 1:
                    logger.warning("trial %d: %s; retrying once", trial.number, e)
                    continue
                trial.set_user_attr("failure_kind", e.kind)
                trial.set_user_attr("failure_message", e.message[-2000:])
                trial.set_user_attr("attempts", attempt)
                # a transient failure says nothing about the settings: hidden, may be tried again
                return self._tell(trial, FAILED, state=TrialState.FAIL if e.kind == TRANSIENT else TrialState.COMPLETE)
        trial.set_user_attr("measurement", m.as_dict())
        trial.set_user_attr("window_values", figures)
        trial.set_user_attr("window_spread", relative_spread(figures))
        constraints = slack(m, self.slo)
        verdict = MEASURED if is_feasible(constraints) else VIOLATES
        return self._tell(trial, verdict, constraints=constraints,
                          values=values(m, self.config.objective, self.config.latency))

    def _figure(self, m: Measurement) -> float:
        return values(m, self.config.objective, self.config.latency)[0]

    def _tell_prior(self, trial: optuna.Trial, prior: optuna.trial.FrozenTrial) -> optuna.trial.FrozenTrial:
        trial.set_user_attr("duplicate_of", prior.number)
        if prior.user_attrs.get("verdict") in (FAILED, KNOWN_FAILURE):
            trial.set_user_attr("failure_kind", prior.user_attrs.get("failure_kind"))
            return self._tell(trial, KNOWN_FAILURE)
        if prior.user_attrs.get("verdict") == PRUNED:
            trial.set_user_attr("pruned_reason", prior.user_attrs.get("pruned_reason"))
            return self._tell(trial, PRUNED)
        trial.set_user_attr("measurement", prior.user_attrs["measurement"])
        return self._tell(trial, DUPLICATE, constraints=prior.user_attrs[CONSTRAINTS_ATTR], values=prior.values)

    def _tell(self, trial: optuna.Trial, verdict: str, *, state: TrialState = TrialState.COMPLETE,
              constraints: list[float] | None = None, values: list[float] | None = None) -> optuna.trial.FrozenTrial:
        """Tells `trial` COMPLETE (or FAIL for `state=FAIL`): without a measurement with
        the penalty values and constraints; INFEASIBLE markers (no latency sample) are
        replaced by the penalty so every told value is finite and comparable."""
        trial.set_user_attr("verdict", verdict)
        worst = penalty_constraints(self.study, self.slo)
        constraints = [w if c >= INFEASIBLE else c for c, w in zip(constraints or worst, worst)]
        dominated = penalty_values(self.study, self.config.objective, self.slo, self.config.latency)
        values = [d if v >= INFEASIBLE else v for v, d in zip(values or dominated, dominated)]
        trial.set_user_attr(CONSTRAINTS_ATTR, constraints)
        if state == TrialState.COMPLETE and verdict not in (MEASURED, VIOLATES, DUPLICATE):
            trial.set_user_attr("told_as", "complete with penalty" if verdict != CUT_SHORT else "complete, partial")
        if NATIVE_CONSTRAINTS:
            for name, value in zip(constraint_names(self.slo), constraints):
                trial.set_constraint(name, value)
        frozen = self.study.tell(trial, values if state == TrialState.COMPLETE else None, state=state)
        self.on_trial(frozen)
        return frozen

    def find_prior(self, settings: EngineSettings, number: int) -> optuna.trial.FrozenTrial | None:
        """An earlier finished trial with the same settings whose outcome is final: a
        measurement, an infeasibility, or a failure that was not transient."""
        wanted = settings.as_dict()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.number == number or t.user_attrs.get("settings") != wanted or "remeasure_of" in t.user_attrs:
                continue
            return t  # transient failures are told FAIL: they may pass later
        return None

    # ------------------------------------------------------------ re-measurement
    def remeasure_best(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Measures the `remeasure_top` best feasible trials once more (each once, also
        across a resume)."""
        done = {t.user_attrs["remeasure_of"] for t in self.study.get_trials(deepcopy=False)
                if "remeasure_of" in t.user_attrs and t.state == TrialState.COMPLETE}
        todo = best_measured(self.study)[: self.config.remeasure_top]
        incumbent = next((t for t in best_measured(self.study) if t.user_attrs.get("is_defaults")), None)
        if todo and incumbent is not None and incumbent.number not in {t.number for t in todo}:  # both spreads
            todo.append(incumbent)
        for t in todo:
            if t.number in done:
                continue
            if stop():
                raise TuningStopped("stopped before the re-measurements")
            self.study.enqueue_trial(t.params, user_attrs={"remeasure_of": t.number})
            self.step()


def penalty_constraints(study: optuna.Study, slo: SLO) -> list[float]:
    """Constraint values for a trial without a measurement (infeasible or failed): per
    constraint, the largest violation measured so far in the study, and at least the
    limit itself (a p95 twice its SLO) or 1 for a zero limit (preemptions, failed
    requests). Units: ms, preemptions/min, requests, as `objective.slack`."""
    limits = [slo.ttft_p95_ms, slo.itl_p95_ms, slo.e2e_p95_ms]
    worst = [lim for lim in limits if lim > 0] + [max(slo.max_preemptions_per_min, 1.0), 1.0]
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("verdict") in (MEASURED, VIOLATES, CUT_SHORT):
            for i, c in enumerate(t.user_attrs.get(CONSTRAINTS_ATTR) or ()):
                if i < len(worst) and c < INFEASIBLE:
                    worst[i] = max(worst[i], c)
    return worst


def penalty_values(study: optuna.Study, objective: str, slo: SLO, latency: str = "e2e") -> list[float]:
    """The dominated objective value(s) of a trial without a measurement: 0 requests/s
    (nothing served), and for 'multi' a p95 latency (ms) no better than the worst
    measured, at least twice its SLO (1 s without one)."""
    if objective != "multi":
        return [0.0]
    limit = {"ttft": slo.ttft_p95_ms, "itl": slo.itl_p95_ms, "e2e": slo.e2e_p95_ms}[latency]
    worst = 2 * limit if limit > 0 else 1000.0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("verdict") in (MEASURED, VIOLATES) and t.values[1] < INFEASIBLE:
            worst = max(worst, t.values[1])
    return [0.0, worst]


def best_measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Original (not duplicate, not re-measure) feasible trials, best first by their first objective value."""
    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    found = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
             if t.user_attrs.get("verdict") == MEASURED and "remeasure_of" not in t.user_attrs]
    return sorted(found, key=lambda t: t.values[0], reverse=maximize)


def trial_summary(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """One trial as the report and status.tuning keep it."""
    m = t.user_attrs.get("measurement") or {}
    return {
        "number": t.number, "state": t.state.name, "verdict": t.user_attrs.get("verdict"),
        "settings": t.user_attrs.get("settings"), "values": list(t.values) if t.values else None,
        "is_defaults": bool(t.user_attrs.get("is_defaults")), "remeasure_of": t.user_attrs.get("remeasure_of"),
        "duplicate_of": t.user_attrs.get("duplicate_of"),
        "reason": t.user_attrs.get("pruned_reason") or t.user_attrs.get("failure_message"),
        "failure_kind": t.user_attrs.get("failure_kind"), "measurement": m,
        "constraints": t.user_attrs.get(CONSTRAINTS_ATTR),
    }
