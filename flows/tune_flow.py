"""``tune``: the Optuna search of ``sim2edge tune`` (:mod:`stages.tune`) with its trials fanned out as Prefect tasks.

The flow asks the study for up to ``parallel`` trials (their parameters suggested here, by the seeded sampler), runs
each as a task (:func:`stages.tune.run_trial`) and tells each result as it ends (COMPLETE with its score, PRUNED, or
FAIL when its training diverged), asking the next while ``trials`` and ``minutes`` last. The study lives in a storage
the trials reach from any process: a journal file in the workspace by default, or ``storage``'s database; so the
flow's task runner may be the thread pool or Ray (``SIM2EDGE_TASK_RUNNER``, :mod:`flows.runners`). Logged to MLflow
as the CLI did (:mod:`flows.tune_log`); the best config is written as a run configuration."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.trial import TrialState
from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed
from pydantic import BaseModel, ConfigDict, Field

from flows.artifact_keys import artifact_key
from flows.run_config import resolve
from flows.runners import task_runner
from flows.tune_log import MlflowTrials
from flows.workspace import Workspace
from registry.tracking import finish_pipeline, start_pipeline
from stages.sim.registry import load
from stages.train import NonFiniteTraining
from stages.train_config import TrainConfig
from stages.tune import (TrialHandle, TrialLog, TuneConfig, TuneResult, make_study, result_of, run_trial, suggest,
                         study_storage, summarize, write_preset)


class TuneParams(BaseModel):
    """One search, how many of its trials run at once, and where the best config goes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    search: TuneConfig = Field(default_factory=TuneConfig, description="Task, budget, evaluation, pruner and the "
                                                                       "search space's discrete choices.")
    parallel: int = Field(1, ge=1, le=64, description="Trials running at once, on the flow's task runner.")
    storage: Optional[str] = Field(None, description="The study's Optuna storage: a database URL every worker "
                                                     "reaches (e.g. postgresql://…, for Ray workers on other hosts) "
                                                     "[default: a journal file under <workspace>/tune].")
    out: Optional[str] = Field(None, description="Where to write the best config [default: "
                                                 "<workspace>/tuned/<task>-tuned.yaml].")


class TuneSummary(BaseModel):
    result: TuneResult
    preset: str
    """The run configuration written: ``sim2edge run --config PRESET``."""
    mlflow_run_id: str
    tracking_uri: str


@task(cache_policy=NO_CACHE)
def trial_task(cfg: TuneConfig, base: TrainConfig, handle: TrialHandle, log: Optional[TrialLog],
               minutes_left: Optional[float]) -> tuple[TrialState, Optional[float]]:
    """One trial's end state and score (None unless COMPLETE)."""
    trial = handle.open()
    try:
        return TrialState.COMPLETE, run_trial(cfg, base, trial, log, minutes_left)
    except optuna.TrialPruned:
        return TrialState.PRUNED, None
    except NonFiniteTraining as e:
        print(f"trial {trial.number} failed: {e}")
        return TrialState.FAIL, None


def search(cfg: TuneConfig, base: TrainConfig, log: Optional[TrialLog], parallel: int, storage: str,
           pruner: Optional[optuna.pruners.BasePruner] = None) -> optuna.Study:
    """Ask up to ``parallel`` trials at a time, run them over the flow's task runner and tell each as it ends; no
    trial starts after ``cfg.trials`` were asked or ``cfg.minutes`` ran out. The study is made in ``storage``
    (:func:`stages.tune.study_storage`), which every trial's process must reach."""
    study = make_study(cfg, pruner, storage)
    end = time.monotonic() + 60 * (cfg.minutes or math.inf)
    running: list[tuple[PrefectFuture, optuna.Trial]] = []
    asked = 0
    while True:
        while len(running) < parallel and asked < cfg.trials and time.monotonic() < end:
            trial = study.ask()
            suggest(trial, cfg)  # here, by the study's seeded sampler; the trial's process reads them back
            left = (end - time.monotonic()) / 60 if cfg.minutes else None
            future = trial_task.with_options(task_run_name=f"trial {trial.number}").submit(
                cfg, base, TrialHandle.of(study, trial, storage), log, left)
            running.append((future, trial))
            asked += 1
        if not running:
            return study
        done = next(as_completed([f for f, _ in running]))
        trial = next(t for f, t in running if f is done)
        running = [(f, t) for f, t in running if f is not done]
        state, value = done.result()
        frozen = study.tell(trial, value, state)
        if log:
            log.finish(result_of(frozen, cfg))


def base_config(task_ref: str) -> TrainConfig:
    """The task preset's training settings: what the search does not set."""
    preset = resolve(task_ref, None, [], {})
    return TrainConfig(task=task_ref, num_envs=preset.num_envs, **preset.train.model_dump())


def journal(home: Path, run_id: str) -> str:
    """The default study storage of the search logged as MLflow run ``run_id``: a journal file in the workspace."""
    path = home / "tune" / f"{run_id}.journal"
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


def trial_rows(result: TuneResult) -> list[dict[str, Any]]:
    return [{"trial": t.number, "state": t.state, "eval return": t.value, **t.params} for t in result.trials]


@flow(name="tune", log_prints=True, task_runner=task_runner())
def tune(params: TuneParams = TuneParams()) -> TuneSummary:
    """Search a task's PPO settings with Optuna, ``params.parallel`` trials at a time; write the best as a run
    configuration. Raises ValueError when no trial completed."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = params.search
    name = load(cfg.task).name
    if params.storage:
        study_storage(params.storage)  # a storage that cannot be opened is refused before anything is logged
    ws = Workspace.from_env()
    ctx = start_pipeline(ws.tracking_uri(), f"sim2edge/{name}", ws.artifact_root(), "tune",
                         {"sim2edge.stage": "tune"}, {**cfg.model_dump(), "parallel": params.parallel})
    log = MlflowTrials(ctx)
    try:
        storage = params.storage or journal(ws.home, ctx.parent_run_id)
        result = summarize(search(cfg, base_config(cfg.task), log, params.parallel, storage), cfg)
        path = write_preset(Path(params.out) if params.out else ws.home / "tuned" / f"{name}-tuned.yaml", result, cfg)
        log.best(result, path)
    except BaseException:
        finish_pipeline(ctx, False)
        raise
    finish_pipeline(ctx, True)
    create_table_artifact(key=artifact_key("tune", name), table=trial_rows(result),
                          description=f"best: trial {result.best_number}, eval return {result.best_value:.4g}; "
                                      f"sim2edge run --config {path}")
    return TuneSummary(result=result, preset=str(path), mlflow_run_id=ctx.parent_run_id, tracking_uri=ctx.tracking_uri)
