"""Creating (or reopening) the Optuna study the tuner drives, with its sampler.

The study lives in durable storage (`sqlite:///tune.db`, opened with `load_if_exists=True`)
so that a killed tuner, restarted with the same storage and name, resumes: finished
trials stay, and a trial that was running when the tuner died is marked failed
('interrupted') and queued again. Samplers: TPE (default; `multivariate=True` so it models
max_num_batched_tokens and max_num_seqs together) or Optuna's Gaussian-process sampler,
both aware of the SLO constraints (stored per trial with `Trial.set_constraint` on Optuna
>= 5, read through `constraints_func` on Optuna 4) so SLO-violating trials steer the search
away.
Sources: Optuna docs, "Ask-and-Tell Interface", "RDB storage", `TPESampler(constraints_func=...)`.
"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from kvpilot.tuner.search.objective import constraints_func, directions

SAMPLERS = ("tpe", "gp", "random")
INTERRUPTED = "interrupted"


# Optuna >= 5 reads constraints that the trial stores (`Trial.set_constraint`) and deprecates
# `constraints_func`; Optuna 4 needs the function. The loop stores them either way.
NATIVE_CONSTRAINTS = hasattr(optuna.trial.Trial, "set_constraint")


def make_sampler(name: str, seed: int | None = 0, n_startup_trials: int = 4) -> optuna.samplers.BaseSampler:
    """'tpe', 'gp' (needs scipy) or 'random', all aware of the SLO constraints."""
    extra = {} if NATIVE_CONSTRAINTS else {"constraints_func": constraints_func}
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials, multivariate=True, **extra)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials, **extra)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler must be one of {SAMPLERS}, got {name!r}")


def open_study(name: str, storage: str | optuna.storages.BaseStorage | None, objective: str = "goodput",
               sampler: str = "tpe", seed: int | None = 0) -> optuna.Study:
    """Creates the study, or loads it when `storage` already holds one called `name`
    (its directions must then match `objective`). storage None keeps it in memory."""
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=directions(objective), sampler=make_sampler(sampler, seed))
    if [d.name.lower() for d in study.directions] != directions(objective):
        raise ValueError(f"study {name!r} in {storage} was created for another objective; use a new --study-name")
    return study


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Marks trials left RUNNING by a killed tuner as failed ('interrupted') and enqueues
    their parameters again, keeping their user attributes (e.g. which trial they
    re-measure). Returns the interrupted trial numbers."""
    numbers = []
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial = optuna.trial.Trial(study, frozen._trial_id)
        trial.set_user_attr("verdict", INTERRUPTED)
        study.tell(frozen.number, state=TrialState.FAIL)
        keep = {k: v for k, v in frozen.user_attrs.items() if k in ("is_defaults", "remeasure_of")}
        study.enqueue_trial(frozen.params, user_attrs=keep)
        numbers.append(frozen.number)
    return numbers
