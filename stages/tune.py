"""Hyperparameter search over :class:`stages.train_config.TrainConfig` with Optuna.

Each trial trains in the task's nominal twin with deterministic evaluation every ``eval_every`` iterations; the
evaluations feed the pruner, and the trial's score is its last one. One trial is :func:`run_trial`: ``tune`` runs
them one after the other (``study.optimize``); the ``tune`` flow (flows/tune_flow.py) asks and tells several at a
time. Logging (MLflow) stays at the edges: a :class:`TrialLog` that the caller passes in.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Protocol

import optuna
import yaml
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError

from stages.sim.registry import load
from stages.train import NonFiniteTraining, deterministic_return, load_actor, train
from stages.train_config import TrainConfig

TUNED = ("learning_rate", "entropy_coef", "gamma", "gae_lambda", "hidden_dims", "num_envs", "steps_per_env",
         "init_noise_std", "desired_kl")
"""The :class:`TrainConfig` fields a search sets."""


class TuneConfig(BaseModel):
    """The search: budget, evaluation, pruner and the discrete choices of the search space."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("cartpole", description="Registered task name or module:Class.")
    trials: int = Field(20, ge=1, description="Trials to run (fewer if ``minutes`` runs out first).")
    minutes: Optional[float] = Field(None, gt=0, description="Wall-clock budget of the whole search.")
    iterations: int = Field(50, ge=1, description="PPO iterations per trial (the cap).")
    minutes_per_trial: Optional[float] = Field(None, gt=0, description="Wall-clock training budget per trial.")
    seed: int = Field(0, description="Seeds the sampler and every trial's training.")
    eval_every: int = Field(5, ge=1, description="Deterministic evaluation (a pruning step) every N iterations.")
    eval_episodes: int = Field(16, ge=1, description="Episodes per deterministic evaluation (fixed seeds).")
    pruner: Literal["median", "halving"] = Field("median", description="Optuna's MedianPruner or "
                                                                      "SuccessiveHalvingPruner.")
    envs_steps: tuple[tuple[int, int], ...] = Field(((64, 32), (128, 32), (256, 16)), min_length=1,
                                                    description="(num_envs, steps_per_env) choices.")
    hidden_dims: tuple[tuple[int, ...], ...] = Field(((64, 64), (128, 128), (256, 128, 64)), min_length=1,
                                                     description="Actor and critic MLP width choices.")
    nthread: int = Field(2, ge=1, description="Physics threads.")


class TrialResult(BaseModel):
    number: int
    state: str
    """Optuna's state name: COMPLETE, PRUNED or FAIL."""
    value: Optional[float]
    params: dict[str, Any]
    """The :data:`TUNED` fields the trial trained with."""


class TuneResult(BaseModel):
    best_number: int
    best_value: float
    best_params: dict[str, Any]
    trials: tuple[TrialResult, ...]


class TrialLog(Protocol):
    """Where a search reports its trials (e.g. one MLflow run each)."""

    def start(self, number: int, params: dict[str, Any]) -> None: ...

    def step(self, number: int, step: int, eval_return: float) -> None: ...

    def finish(self, result: TrialResult) -> None: ...


def _key(values: tuple[int, ...], sep: str) -> str:
    return sep.join(map(str, values))


def suggest(trial: optuna.Trial, cfg: TuneConfig) -> dict[str, Any]:
    """Sample the trial's :data:`TUNED` values (categorical tuples are sampled as their string keys)."""
    trial.suggest_categorical("envs_steps", [_key(c, "x") for c in cfg.envs_steps])
    trial.suggest_float("learning_rate", 1e-4, 3e-3, log=True)
    trial.suggest_float("entropy_coef", 0.0, 0.02)
    trial.suggest_float("gamma", 0.95, 0.999)
    trial.suggest_float("gae_lambda", 0.9, 0.99)
    trial.suggest_categorical("hidden_dims", [_key(c, "-") for c in cfg.hidden_dims])
    trial.suggest_float("init_noise_std", 0.2, 1.2)
    trial.suggest_float("desired_kl", 0.005, 0.05, log=True)
    return decode(trial.params, cfg)


def decode(params: dict[str, Any], cfg: TuneConfig) -> dict[str, Any]:
    """The :data:`TUNED` values of a trial's Optuna params; {} for a trial that sampled none."""
    if not params:
        return {}
    envs_steps = {_key(c, "x"): c for c in cfg.envs_steps}
    hidden = {_key(c, "-"): c for c in cfg.hidden_dims}
    num_envs, steps_per_env = envs_steps[params["envs_steps"]]
    floats = ("learning_rate", "entropy_coef", "gamma", "gae_lambda", "init_noise_std", "desired_kl")
    return {**{k: params[k] for k in floats}, "hidden_dims": hidden[params["hidden_dims"]], "num_envs": num_envs,
            "steps_per_env": steps_per_env}


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    return optuna.pruners.MedianPruner() if name == "median" else optuna.pruners.SuccessiveHalvingPruner()


def study_storage(spec: str) -> optuna.storages.BaseStorage:
    """Optuna's storage for ``spec``: a database URL (``sqlite:///…``, ``postgresql://…``, for workers on other
    hosts) or else the path of a journal file (processes on one host)."""
    try:
        if "://" in spec:
            return optuna.storages.RDBStorage(spec)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(spec))
    except (SQLAlchemyError, OSError) as e:  # an unknown dialect, a refused connection, a folder that is not there
        raise ValueError(f"study storage {spec!r}: Optuna cannot open it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from None


def make_study(cfg: TuneConfig, pruner: Optional[optuna.pruners.BasePruner] = None,
               storage: Optional[str] = None) -> optuna.Study:
    """A study maximizing the score: TPE seeded by ``cfg.seed``; ``pruner`` overrides ``cfg.pruner``; in memory, or
    named ``tune`` in ``storage`` (:func:`study_storage`), where worker processes reach it."""
    return optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=cfg.seed),
                               pruner=pruner or make_pruner(cfg.pruner), study_name="tune" if storage else None,
                               storage=study_storage(storage) if storage else None)


@dataclass(frozen=True)
class TrialHandle:
    """One asked trial of a study in a storage: what a worker process needs to report to it and be pruned by it."""

    storage: str
    study: str
    trial_id: int
    pruner: optuna.pruners.BasePruner

    @classmethod
    def of(cls, study: optuna.Study, trial: optuna.Trial, storage: str) -> TrialHandle:
        return cls(storage, study.study_name, trial._trial_id, study.pruner)  # Optuna names a trial by its id

    def open(self) -> optuna.Trial:
        """The trial, read from the storage; its parameters are the ones suggested where it was asked."""
        study = optuna.load_study(study_name=self.study, storage=study_storage(self.storage), pruner=self.pruner)
        return optuna.Trial(study, self.trial_id)


def trial_config(cfg: TuneConfig, base: TrainConfig, values: dict[str, Any],
                 minutes_left: Optional[float]) -> TrainConfig:
    """``base`` with the trial's values and ``cfg``'s budget and evaluation; its minutes the smaller of
    ``cfg.minutes_per_trial`` and what is left of the search (``minutes_left``)."""
    limits = [m for m in (cfg.minutes_per_trial, minutes_left) if m is not None]
    return TrainConfig.model_validate({
        **base.model_dump(), **values, "task": cfg.task, "iterations": cfg.iterations, "seed": cfg.seed,
        "eval_every": cfg.eval_every, "eval_episodes": cfg.eval_episodes, "nthread": cfg.nthread,
        "target_return": None, "checkpoint_every": 0, "minutes": max(min(limits), 1e-3) if limits else None})


def run_trial(cfg: TuneConfig, base: TrainConfig, trial: optuna.Trial, log: Optional[TrialLog] = None,
              minutes_left: Optional[float] = None) -> float:
    """Train one trial in the task's nominal twin and return its score. Raises :class:`optuna.TrialPruned` when the
    pruner stops it at an evaluation, :class:`NonFiniteTraining` when training diverges (the checkpoints live in a
    temporary folder). Works with ``study.optimize`` and with ``study.ask``/``tell``."""
    task = load(cfg.task)
    twin = task.nominal_params()
    values = suggest(trial, cfg)
    last: dict[str, float] = {}

    def on_iteration(it: int, metrics: dict[str, float]) -> None:
        if "eval_return" not in metrics:
            return
        last.update(step=it + 1, value=metrics["eval_return"])
        trial.report(metrics["eval_return"], it + 1)
        if log:
            log.step(trial.number, it + 1, metrics["eval_return"])
        if trial.should_prune():
            raise optuna.TrialPruned(f"eval_return {metrics['eval_return']:.3f} at iteration {it + 1}")

    if log:
        log.start(trial.number, values)
    with tempfile.TemporaryDirectory(prefix=f"sim2edge-tune-{trial.number}-") as tmp:
        ckpt = train(trial_config(cfg, base, values, minutes_left), twin, Path(tmp) / "checkpoint",
                     on_iteration=on_iteration)
        if last.get("step") == ckpt.iterations:
            return last["value"]
        # stopped by its minutes between evaluations: score the final policy
        value = deterministic_return(load_actor(ckpt.path), task, twin, cfg.eval_episodes, cfg.nthread)
    if log:
        log.step(trial.number, ckpt.iterations, value)
    return value


def tune(cfg: TuneConfig, base: Optional[TrainConfig] = None, log: Optional[TrialLog] = None,
         pruner: Optional[optuna.pruners.BasePruner] = None) -> TuneResult:
    """Run the search one trial at a time (:func:`run_trial`); ``base`` gives the fields not searched (e.g. the task
    preset's disturbance; its task, budget and evaluation are ``cfg``'s), ``pruner`` overrides ``cfg.pruner``. A trial
    whose training diverges is FAIL; a search with no COMPLETE trial raises ValueError."""
    base = base or TrainConfig(task=cfg.task)
    end = time.monotonic() + 60 * (cfg.minutes or math.inf)

    def objective(trial: optuna.Trial) -> float:
        return run_trial(cfg, base, trial, log, (end - time.monotonic()) / 60 if cfg.minutes else None)

    def finished(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if log:
            log.finish(result_of(trial, cfg))

    study = make_study(cfg, pruner)
    study.optimize(objective, n_trials=cfg.trials, timeout=60 * cfg.minutes if cfg.minutes else None,
                   catch=(NonFiniteTraining,), callbacks=[finished])
    return summarize(study, cfg)


def summarize(study: optuna.Study, cfg: TuneConfig) -> TuneResult:
    """The study's trials and its best COMPLETE one; ValueError when none completed."""
    trials = tuple(result_of(t, cfg) for t in study.trials)
    complete = [t for t in trials if t.state == "COMPLETE"]
    if not complete:
        raise ValueError(f"no trial completed ({', '.join(f'{t.number}: {t.state}' for t in trials)})")
    best = max(complete, key=lambda t: t.value)
    return TuneResult(best_number=best.number, best_value=best.value, best_params=best.params, trials=trials)


def result_of(trial: optuna.trial.FrozenTrial, cfg: TuneConfig) -> TrialResult:
    return TrialResult(number=trial.number, state=trial.state.name, value=trial.value, params=decode(trial.params, cfg))


def preset_yaml(result: TuneResult, cfg: TuneConfig) -> str:
    """The best trial's values as a run configuration (``sim2edge run --config``): ``num_envs`` at the top,
    the PPO settings under ``train:``; iterations and the rest stay the task preset's."""
    p = result.best_params
    train_keys = [k for k in TUNED if k != "num_envs"]
    body = {"task": cfg.task, "num_envs": p["num_envs"],
            "train": {k: list(p[k]) if k == "hidden_dims" else p[k] for k in train_keys}}
    header = (f"# sim2edge tune: trial {result.best_number} of {len(result.trials)}, deterministic eval return "
              f"{result.best_value:.4g}\n# ({cfg.iterations} iterations per trial, {cfg.eval_episodes} episodes, "
              f"seed {cfg.seed}, nominal twin)\n")
    return header + yaml.safe_dump(body, sort_keys=False)


def write_preset(path: Path, result: TuneResult, cfg: TuneConfig) -> Path:
    """Write the preset atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(preset_yaml(result, cfg))
    tmp.replace(path)
    return path
