"""`KubernetesRunner`: runs trials by editing an InferenceService.

Per trial: merge-patch the trial's settings into `spec.engine` and its pod count into
`spec.parallelism.nnodes`, in one patch (the API server's CRD rules may refuse them: a
rejected trial), wait until the operator reports the rollout done
(`status.observedGeneration` >= the new generation, `Ready` True, and
`status.appliedEngineArgs` carrying the trial's flags; with nnodes > 1 `status.groupSize` is
nnodes and Ready means every pod of every group is ready), then measure a window. Progress goes
into `status.tuning` (phase, trial, bestTrial, bestObjective, bestEngine, a short history)
through the status subresource, which the operator's own status writes leave alone.
`finish` writes the best settings into `spec.engine`, so the pods' flags match what runs.
With live traffic, a trial cut short for a clear SLO violation puts the best known settings
back at once (the next trial's rollout, or `finish`, follows).

A pod lost during the window (an engine that exits, or with nnodes > 1 any member of a
group: the engine's node 0 exits when a node is lost, and the group restarts) shows as the
InferenceService's `Ready` condition leaving True after the rollout: its status is not True,
or its lastTransitionTime moved. The window is then void: the trial fails as transient
(tried once more, then hidden from the sampler, `kvpilot.tuner.failures`) and the best known
settings are put back at once, as for a trial cut short.
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
from kvpilot.tuner.failures import TrialCutShort
from kvpilot.tuner.search.loop import best_measured
from kvpilot.tuner.search.objective import Measurement
from kvpilot.tuner.search.settings import SPEC_KEYS, EngineSettings
from kvpilot.tuner.measure.window import config_mismatches

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
    """The resource's status.conditions by type ({"Ready": {...}, ...}; Kubernetes API conventions)."""
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or ()}


class KubernetesRunner:
    """measure(number, settings) measures the rolled-out engine (see
    `kvpilot.tuner.measure.trial_window.WindowMeasurer`)."""

    def __init__(self, kube: KubeClient, namespace: str, name: str,
                 measure: Callable[[int, EngineSettings], Measurement], rollout_timeout_s: float = 600.0,
                 poll_s: float = 0.5, loss_grace_s: float = 30.0):
        self.kube, self.namespace, self.name = kube, namespace, name
        self.measure = measure
        self.rollout_timeout_s, self.poll_s = rollout_timeout_s, poll_s
        self.loss_grace_s = loss_grace_s  # after a failed window: how long the operator may take to report a lost pod
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
                            **{CRD_FIELDS[name]: s.get(name) for name in HISTORY_SETTINGS},
                            "nnodes": s.get("nnodes", 1)})  # spec.parallelism.nnodes: the pods it ran on
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
        """Patches spec.engine and spec.parallelism.nnodes (`EngineSettings.to_spec`) in one
        merge patch; returns the resource's new generation."""
        try:
            obj = self.kube.patch_isvc(self.namespace, self.name, {"spec": settings.to_spec()})
        except ApiError as e:
            if e.status in (400, 422):
                raise TrialFailed(REJECTED, f"the API server refused spec.engine / spec.parallelism: "
                                            f"{e.message}") from e
            raise TrialFailed(TRANSIENT, f"patching spec.engine / spec.parallelism failed: {e}") from e
        return int(obj["metadata"].get("generation") or 0)

    def wait_rollout(self, generation: int, settings: EngineSettings) -> dict[str, Any]:
        """Blocks until the operator reports `generation` rolled out with `settings` (and its
        pods per group: status.groupSize, absent for one pod). Raises TrialFailed: rejected
        when the operator marks the spec Failed, transient when the rollout stalls (Degraded
        by a progress deadline) or times out."""
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
                if int(status.get("groupSize") or 1) != settings.nnodes:
                    wrong["nnodes"] = (str(settings.nnodes), str(status.get("groupSize") or 1))
                if ready.get("status") == "True" and not wrong:
                    return obj
                last = f"Ready={ready.get('status')} ({ready.get('message')}), differing args {wrong}"
            time.sleep(self.poll_s)
        raise TrialFailed(TRANSIENT, f"rollout of generation {generation} not done in {self.rollout_timeout_s:.0f} s: "
                                     f"{last}")

    def pod_lost(self, rolled_out: dict[str, Any], wait_s: float = 0.0) -> str:
        """Why the engine's pods are not all as they were at the rollout (`rolled_out`, the
        resource `wait_rollout` returned): Ready no longer True, or True since a later
        transition (a pod left and came back). '' when nothing was lost; polls up to wait_s
        for the operator to report a loss."""
        since = conditions(rolled_out).get("Ready", {}).get("lastTransitionTime")
        deadline = time.monotonic() + wait_s
        while True:
            conds = conditions(self.kube.get_isvc(self.namespace, self.name))
            ready, degraded = conds.get("Ready", {}), conds.get("Degraded", {})
            if ready.get("status") != "True":  # Degraded says which group restarts and why (operator/status.py)
                why = f"; {degraded.get('message')}" if degraded.get("status") == "True" else ""
                return (f"an engine pod was lost during the trial: Ready is {ready.get('status')} "
                        f"({ready.get('reason')}: {ready.get('message')}){why}")
            if ready.get("lastTransitionTime") != since:
                return (f"an engine pod was lost and came back during the trial: Ready since "
                        f"{ready.get('lastTransitionTime')}, was since {since}")
            if time.monotonic() >= deadline:
                return ""
            time.sleep(self.poll_s)

    def restore_best(self, number: int, why: str) -> None:
        """Puts the best known settings back at once (nothing before a trial was measured)."""
        if self.best_settings is not None:
            logger.warning("trial %d %s; restoring trial %s's settings", number, why, self.best_trial)
            self.apply(self.best_settings)

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        """Runner.run_trial: patches `settings` in, waits for the rollout, measures a window (goodput in
        req/s). Raises TrialFailed (rejected; transient: a stalled rollout, or a pod lost in the window)
        and TrialCutShort; after a lost pod or a cut the best known settings go back at once."""
        self.write_tuning(phase="Running", trial=number)
        generation = self.apply(settings)
        rolled_out = self.wait_rollout(generation, settings)
        try:
            m = self.measure(number, settings)
        except TrialCutShort:
            self.restore_best(number, "cut short")  # users get the best known settings back at once
            raise
        except TrialFailed as e:
            lost = self.pod_lost(rolled_out, self.loss_grace_s)
            if lost:
                self.restore_best(number, "lost a pod")
                raise TrialFailed(TRANSIENT, f"{lost}; the window: {e.message}") from e
            raise
        lost = self.pod_lost(rolled_out)
        if lost:  # the window ran on a group that lost a member: it measures no settings
            self.restore_best(number, "lost a pod")
            raise TrialFailed(TRANSIENT, lost)
        m.extra.update(generation=generation)
        logger.info("trial %d (%s, generation %d): goodput %.3f req/s", number, settings.describe(), generation,
                    m.goodput_rps)
        return m

    def finish(self, best: EngineSettings | None, original: EngineSettings, best_trial: int | None,
               best_objective: float | None, phase: str = "Done") -> EngineSettings:
        """Writes the best settings (or, when no trial met the SLOs, the original ones) into
        spec.engine, waits for that rollout, and sets status.tuning.phase to `phase` (Done; a
        continuous session: Watching). Returns what runs."""
        final = best or original
        self.wait_rollout(self.apply(final), final)
        fields: dict[str, Any] = {"phase": phase, "bestEngine": final.to_engine_spec()}
        if best_trial is not None:
            fields.update(bestTrial=best_trial, bestObjective=best_objective)
        self.write_tuning(**fields)
        return final
