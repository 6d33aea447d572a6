"""`KubernetesRunner`: runs trials by editing an InferenceService.

Per trial: merge-patch the trial's settings into `spec.engine` (the API server's CRD rules
may refuse them: a rejected trial), wait until the operator reports the rollout done
(`status.observedGeneration` >= the new generation, `Ready` True, and
`status.appliedEngineArgs` carrying the trial's flags), then measure a window. Progress goes
into `status.tuning` (phase, trial, bestTrial, bestObjective, bestEngine, a short history)
through the status subresource, which the operator's own status writes leave alone.
`finish` writes the best settings into `spec.engine`, so the pods' flags match what runs.
With live traffic, a trial cut short for a clear SLO violation puts the best known settings
back at once (the next trial's rollout, or `finish`, follows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import optuna

from kvpilot.engine.settings import BY_NAME, CRD_FIELDS, flag_value
from kvpilot.tuner.failures import REJECTED, TRANSIENT, TrialFailed
from kvpilot.api.kube import ApiError, KubeClient
from kvpilot.tuner.local import TrialCutShort
from kvpilot.tuner.loop import best_measured
from kvpilot.tuner.objective import Measurement
from kvpilot.tuner.settings import SPEC_KEYS, EngineSettings
from kvpilot.tuner.window import config_mismatches

logger = logging.getLogger("kvpilot.tuner")
HISTORY_LENGTH = 20
# the settings each status.tuning.history entry shows, under their spec.engine keys
HISTORY_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill")


def flag_values(args: list[str]) -> dict[str, str]:
    """{setting: value} from a rendered engine command line; booleans from `--x` / `--no-x`
    (absent: the setting's default), as strings."""
    values = {}
    for key in SPEC_KEYS:
        setting = BY_NAME[key]
        if setting.type is bool:
            negated = "--no-" + setting.flag[2:]
            values[key] = str(setting.flag in args or (setting.default and negated not in args))
        elif (value := flag_value(args, key)) is not None:
            values[key] = value
    return values


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or ()}


class KubernetesRunner:
    """measure(number, settings) measures the rolled-out engine (see
    `kvpilot.tuner.local.WindowMeasurer`)."""

    def __init__(self, kube: KubeClient, namespace: str, name: str,
                 measure: Callable[[int, EngineSettings], Measurement], rollout_timeout_s: float = 600.0,
                 poll_s: float = 0.5):
        self.kube, self.namespace, self.name = kube, namespace, name
        self.measure = measure
        self.rollout_timeout_s, self.poll_s = rollout_timeout_s, poll_s
        self.best_settings: EngineSettings | None = None  # kept current by `record`
        self.best_trial: int | None = None

    # ------------------------------------------------------------ status
    def write_tuning(self, **fields: Any) -> None:
        """Merge-patches status.tuning (only the given keys change)."""
        try:
            self.kube.patch_status(self.namespace, self.name, {"tuning": fields})
        except ApiError as e:
            logger.warning("could not write status.tuning: %s", e)

    def record(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """After each trial: the history, the best so far (the `on_trial` callback)."""
        history = []
        for t in study.get_trials(deepcopy=False)[-HISTORY_LENGTH:]:
            if t.state == optuna.trial.TrialState.RUNNING:
                continue
            s = t.user_attrs.get("settings") or {}
            history.append({"trial": t.number, "verdict": t.user_attrs.get("verdict", t.state.name.lower()),
                            "objective": t.values[0] if t.values else None,
                            **{CRD_FIELDS[name]: s.get(name) for name in HISTORY_SETTINGS}})
        fields: dict[str, Any] = {"phase": "Running", "trial": frozen.number, "history": history}
        best = best_measured(study)
        if best:
            self.best_settings = EngineSettings(**best[0].user_attrs["settings"])
            self.best_trial = best[0].number
            fields.update(bestTrial=best[0].number, bestObjective=best[0].values[0],
                          bestEngine=self.best_settings.to_engine_spec())
        self.write_tuning(**fields)

    # ------------------------------------------------------------ rollout
    def apply(self, settings: EngineSettings) -> int:
        """Patches spec.engine; returns the resource's new generation."""
        try:
            obj = self.kube.patch_isvc(self.namespace, self.name, {"spec": {"engine": settings.to_engine_spec()}})
        except ApiError as e:
            if e.status in (400, 422):
                raise TrialFailed(REJECTED, f"the API server refused spec.engine: {e.message}") from e
            raise TrialFailed(TRANSIENT, f"patching spec.engine failed: {e}") from e
        return int(obj["metadata"].get("generation") or 0)

    def wait_rollout(self, generation: int, settings: EngineSettings) -> dict[str, Any]:
        """Blocks until the operator reports `generation` rolled out with `settings`.
        Raises TrialFailed: rejected when the operator marks the spec Failed, transient
        when the rollout stalls (Degraded by a progress deadline) or times out."""
        deadline = time.monotonic() + self.rollout_timeout_s
        last = "no status yet"
        while time.monotonic() < deadline:
            obj = self.kube.get_isvc(self.namespace, self.name)
            status, conds = obj.get("status") or {}, conditions(obj)
            if int(status.get("observedGeneration") or 0) >= generation:
                failed, ready, degraded = conds.get("Failed", {}), conds.get("Ready", {}), conds.get("Degraded", {})
                if failed.get("status") == "True":
                    raise TrialFailed(REJECTED, f"the operator refused the spec: {failed.get('message')}")
                if degraded.get("reason") == "ProgressDeadlineExceeded":
                    raise TrialFailed(TRANSIENT, f"the rollout stalled: {degraded.get('message')}")
                wrong = config_mismatches(flag_values(status.get("appliedEngineArgs") or []), settings.as_dict())
                if ready.get("status") == "True" and not wrong:
                    return obj
                last = f"Ready={ready.get('status')} ({ready.get('message')}), differing args {wrong}"
            time.sleep(self.poll_s)
        raise TrialFailed(TRANSIENT, f"rollout of generation {generation} not done in {self.rollout_timeout_s:.0f} s: "
                                     f"{last}")

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        self.write_tuning(phase="Running", trial=number)
        generation = self.apply(settings)
        self.wait_rollout(generation, settings)
        try:
            m = self.measure(number, settings)
        except TrialCutShort:
            if self.best_settings is not None:  # users get the best known settings back at once
                logger.warning("trial %d cut short; restoring trial %s's settings", number, self.best_trial)
                self.apply(self.best_settings)
            raise
        m.extra.update(generation=generation)
        logger.info("trial %d (%s, generation %d): goodput %.3f req/s", number, settings.describe(), generation,
                    m.goodput_rps)
        return m

    def finish(self, best: EngineSettings | None, original: EngineSettings, best_trial: int | None,
               best_objective: float | None) -> EngineSettings:
        """Writes the best settings (or, when no trial met the SLOs, the original ones) into
        spec.engine, waits for that rollout, and marks the tuning Done. Returns what runs."""
        final = best or original
        self.wait_rollout(self.apply(final), final)
        fields: dict[str, Any] = {"phase": "Done", "bestEngine": final.to_engine_spec()}
        if best_trial is not None:
            fields.update(bestTrial=best_trial, bestObjective=best_objective)
        self.write_tuning(**fields)
        return final
