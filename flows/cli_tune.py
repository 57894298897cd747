"""``sim2edge tune``: search a task's PPO settings with Optuna (:mod:`stages.tune`), one MLflow run per trial under
a ``tune`` parent run, the best written as a run configuration for ``sim2edge run --config``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows.cli_output import check_task, console, fail, listing, print_listing
from flows.workspace import Workspace


def tune(
    task: str = typer.Option("cartpole", help="Registered task or module:Class."),
    trials: int = typer.Option(20, min=1, help="Trials to run."),
    minutes: Optional[float] = typer.Option(None, min=0.01, help="Wall-clock budget of the whole search."),
    iterations: int = typer.Option(50, min=1, help="PPO iterations per trial."),
    eval_every: int = typer.Option(5, min=1, help="Deterministic evaluation (a pruning step) every N iterations."),
    eval_episodes: int = typer.Option(16, min=1, help="Episodes per deterministic evaluation."),
    pruner: str = typer.Option("median", help="median or halving (successive halving)."),
    seed: int = typer.Option(0, help="Seeds the sampler and every trial."),
    out: Optional[Path] = typer.Option(None, help="Where to write the best config [default: ./<task>-tuned.yaml]."),
) -> None:
    """Search learning rate, entropy, γ, λ, network sizes, envs × steps, noise std and desired KL with Optuna.

    Each trial trains in the task's nominal twin and is scored by its last deterministic evaluation; weak trials are
    pruned early. The best config is written as a run configuration: `sim2edge run --config FILE`."""
    check_task(task)
    if pruner not in ("median", "halving"):
        fail(f"--pruner {pruner!r}: choose median or halving")
    import optuna

    from flows.run_config import resolve
    from flows.tune_log import MlflowTrials
    from registry.tracking import finish_pipeline, start_pipeline
    from stages.sim.registry import load
    from stages.train import TrainConfig
    from stages.tune import TuneConfig, tune as search, write_preset

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = TuneConfig(task=task, trials=trials, minutes=minutes, iterations=iterations, eval_every=eval_every,
                     eval_episodes=eval_episodes, pruner=pruner, seed=seed)
    preset = resolve(task, None, [], {})  # the task preset's settings for what the search does not set
    base = TrainConfig(task=task, num_envs=preset.num_envs, **preset.train.model_dump())
    name = load(task).name
    ws = Workspace.from_env()
    ctx = start_pipeline(ws.tracking_uri(), f"sim2edge/{name}", ws.artifact_root(), "tune",
                         {"sim2edge.stage": "tune"}, cfg.model_dump())
    log = MlflowTrials(ctx)
    try:
        result = search(cfg, base, log)
    except ValueError as e:
        finish_pipeline(ctx, False)
        fail(str(e))
    except BaseException:
        finish_pipeline(ctx, False)
        raise
    path = write_preset(out or Path(f"{name}-tuned.yaml"), result, cfg)
    log.best(result, path)
    finish_pipeline(ctx, True)
    rows = [[str(t.number), t.state, "" if t.value is None else f"{t.value:.2f}",
             ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())]
            for t in result.trials]
    print_listing(listing(["trial", "state", "eval return", "params"], rows))
    console.print(f"best: trial {result.best_number}, eval return {result.best_value:.2f}; MLflow run "
                  f"{ctx.parent_run_id} ({ctx.tracking_uri})", markup=False, highlight=False, soft_wrap=True)
    console.print(f"sim2edge run --config {path}", markup=False, highlight=False, soft_wrap=True)
