"""Re-tuning from what the tuner already knows (continuous mode, `kvpilot.tuner.continuous`).

Every study of one InferenceService lives in the same Optuna storage (the ConfigMap journal
in a cluster, `kvpilot.tuner.cluster.journal`; `--storage` or memory locally), named `NAME` for the
first and `NAME-1`, `NAME-2`, ... for those the watcher starts. Each carries, as a study
user attribute, the workload shape it was tuned on (`kvpilot.tuner.measure.shape.WorkloadShape`).
A new study starts from the nearest earlier workload (smallest `shape.distance`): its best
feasible trials are enqueued first, then the settings running now as the baseline (the
incumbent the decision compares against, `is_defaults`), so the search begins where the
field knowledge says it should (Optuna's `Study.enqueue_trial`, the way vLLM's auto_tune
and Optuna's docs seed a study with known-good points) instead of at the defaults.
Settings the user pinned (spec.tuning.pinned) are taken from the running settings in every
seed, so no trial and no restore changes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import optuna

from kvpilot.engine.config import ModelConfig
from kvpilot.tuner.search.loop import best_measured
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.shape import WorkloadShape, distance
from kvpilot.tuner.search.space import SearchSpace

logger = logging.getLogger("kvpilot.tuner")

SHAPE_ATTR = "workload_shape"  # study user attribute: WorkloadShape.as_dict() of the workload it was tuned on
SEEDED_FROM = "seeded_from"    # trial user attribute: "STUDY#TRIAL" it was copied from


def study_names(storage: optuna.storages.BaseStorage, base_name: str) -> list[str]:
    """The studies of one session in the order they started: `base_name`, then
    `base_name-1`, `base_name-2`, ..."""
    found: dict[int, str] = {}
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        name = summary.study_name
        if name == base_name:
            found[0] = name
        elif name.startswith(base_name + "-") and name[len(base_name) + 1:].isdigit():
            found[int(name[len(base_name) + 1:])] = name
    return [found[k] for k in sorted(found)]


def record_shape(study: optuna.Study, shape: WorkloadShape) -> None:
    """Stores the workload `study` was tuned on (kept in the storage with its trials)."""
    study.set_user_attr(SHAPE_ATTR, shape.as_dict())


def shape_of(study: optuna.Study) -> WorkloadShape | None:
    """The workload shape recorded on `study`, or None."""
    value = study.user_attrs.get(SHAPE_ATTR)
    return WorkloadShape.from_dict(value) if value else None


def nearest_study(storage: optuna.storages.BaseStorage, names: Iterable[str], shape: WorkloadShape,
                  exclude: str | None = None) -> optuna.Study | None:
    """Among the studies `names` (except `exclude`) that recorded a shape and have a feasible
    trial, the one whose workload is nearest `shape` (`kvpilot.tuner.measure.shape.distance`); None
    when there is none."""
    best: tuple[float, optuna.Study] | None = None
    for name in names:
        if name == exclude:
            continue
        study = optuna.load_study(study_name=name, storage=storage)
        known = shape_of(study)
        if known is None or not best_measured(study):
            continue
        d = distance(known, shape)
        if best is None or d < best[0]:
            best = (d, study)
    return best[1] if best else None


def with_pins(settings: EngineSettings, running: EngineSettings, pinned: Iterable[str]) -> EngineSettings:
    """`settings` with every pinned setting (TUNED_SETTINGS names) at its running value; a
    pinned parallel size pins the layout (both sizes and nnodes)."""
    values = {}
    for name in pinned:
        if name in ("tensor_parallel_size", "pipeline_parallel_size"):
            values.update(tensor_parallel_size=running.tensor_parallel_size,
                          pipeline_parallel_size=running.pipeline_parallel_size, nnodes=running.nnodes)
        else:
            values[name] = getattr(running, name)
    return settings.replace(**values)


def seed(study: optuna.Study, earlier: optuna.Study | None, running: EngineSettings, space: SearchSpace,
         model: ModelConfig, pinned: Iterable[str] = (), top: int = 3) -> EngineSettings | None:
    """Enqueues, in a new `study`, the `top` best feasible trials of `earlier` (pins applied)
    and then `running` as the baseline (`is_defaults`). Returns the best known settings for
    the new workload (earlier's best, pins applied), or None without an earlier study. A
    study that already has trials (a resumed one) is left as it is."""
    if study.get_trials(deepcopy=False):
        return None
    pinned = tuple(pinned)
    best_known = None
    seen: set[str] = set()
    for t in best_measured(earlier)[:top] if earlier is not None else ():
        settings = with_pins(EngineSettings(**t.user_attrs["settings"]), running, pinned)
        best_known = best_known or settings
        key = repr(settings.as_dict())
        if key in seen or settings == running:
            continue
        seen.add(key)
        study.enqueue_trial(space.params_of(settings, model),
                            user_attrs={SEEDED_FROM: f"{earlier.study_name}#{t.number}"})
    study.enqueue_trial(space.params_of(running, model), user_attrs={"is_defaults": True})
    if earlier is not None:
        logger.info("study %s seeded from %s (%d trials) and the running settings %s", study.study_name,
                    earlier.study_name, len(seen), running.describe())
    return best_known


def prepare(study: optuna.Study, storage: optuna.storages.BaseStorage, base_name: str, running: EngineSettings,
            space: SearchSpace, model: ModelConfig, pinned: Iterable[str] = ()) -> EngineSettings | None:
    """Before a study the watcher started (any but `base_name`) runs: seeds it (`seed`) from
    the nearest earlier study by the shape recorded on it. Returns the best known settings
    for its workload (None for the first study, a resumed one, or without an earlier one)."""
    if study.study_name == base_name:
        return None
    shape = shape_of(study)
    earlier = (nearest_study(storage, study_names(storage, base_name), shape, exclude=study.study_name)
               if shape is not None else None)
    return seed(study, earlier, running, space, model, pinned)
