"""``sim2edge tune``: search a task's PPO settings with Optuna (:mod:`stages.tune`), one MLflow run per trial under
a ``tune`` parent run, the best written as a run configuration for ``sim2edge run --config``; it runs the Prefect
flow ``tune`` (:mod:`flows.tune_flow`) in this process."""

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
    parallel: int = typer.Option(1, min=1, max=64, help="Trials running at once, on the flow's task runner "
                                                        "(threads; Ray with SIM2EDGE_TASK_RUNNER=ray or ray://…)."),
    storage: Optional[str] = typer.Option(None, help="The study's Optuna storage, a database URL every worker "
                                                     "reaches [default: a journal file under the workspace]."),
    out: Optional[Path] = typer.Option(None, help="Where to write the best config [default: ./<task>-tuned.yaml]."),
) -> None:
    """Search learning rate, entropy, γ, λ, network sizes, envs × steps, noise std and desired KL with Optuna.

    Each trial trains in the task's nominal twin and is scored by its last deterministic evaluation; weak trials are
    pruned early. Runs as the Prefect flow `tune`. The best config is written as a run configuration:
    `sim2edge run --config FILE`."""
    check_task(task)
    if pruner not in ("median", "halving"):
        fail(f"--pruner {pruner!r}: choose median or halving")
    ws = Workspace.from_env()
    ws.home.mkdir(parents=True, exist_ok=True)
    ws.configure_prefect()
    from flows.tune_flow import TuneParams, tune as tune_flow
    from stages.sim.registry import load
    from stages.tune import TuneConfig

    cfg = TuneConfig(task=task, trials=trials, minutes=minutes, iterations=iterations, eval_every=eval_every,
                     eval_episodes=eval_episodes, pruner=pruner, seed=seed)
    path = (out or Path(f"{load(task).name}-tuned.yaml")).absolute()
    try:
        summary = tune_flow(TuneParams(search=cfg, parallel=parallel, storage=storage, out=str(path)))
    except ValueError as e:
        fail(str(e))
    result = summary.result
    rows = [[str(t.number), t.state, "" if t.value is None else f"{t.value:.2f}",
             ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())]
            for t in result.trials]
    print_listing(listing(["trial", "state", "eval return", "params"], rows))
    console.print(f"best: trial {result.best_number}, eval return {result.best_value:.2f}; MLflow run "
                  f"{summary.mlflow_run_id} ({summary.tracking_uri})", markup=False, highlight=False, soft_wrap=True)
    console.print(f"sim2edge run --config {summary.preset}", markup=False, highlight=False, soft_wrap=True)
