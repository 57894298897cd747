"""MLflow logging of ``sim2edge tune``: one nested run per Optuna trial under the search's parent run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from registry.tracking import OWNER, RunContext, log_metrics, log_params, owner
from stages.tune import TrialResult, TuneResult

TERMINAL = {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}
"""MLflow's run status for an Optuna trial state (anything else: FAILED)."""


class MlflowTrials:
    """A :class:`stages.tune.TrialLog`: one nested MLflow run per trial, ``eval_return`` at each evaluation."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.client, self.runs = ctx, ctx.client, {}

    def start(self, number: int, params: dict[str, Any]) -> None:
        run = self.client.create_run(self.ctx.experiment_id, run_name=f"trial-{number}",
                                     tags={"mlflow.parentRunId": self.ctx.parent_run_id, OWNER: owner(),
                                           "sim2edge.stage": "tune-trial"})
        self.runs[number] = run.info.run_id
        log_params(self.client, run.info.run_id, params)

    def step(self, number: int, step: int, eval_return: float) -> None:
        log_metrics(self.client, self.runs[number], {"eval_return": eval_return}, step)

    def finish(self, result: TrialResult) -> None:
        if result.number not in self.runs:  # failed before its training started
            return
        run_id = self.runs[result.number]
        self.client.set_tag(run_id, "sim2edge.trial_state", result.state)
        if result.value is not None:
            log_metrics(self.client, run_id, {"score": result.value})
        self.client.set_terminated(run_id, TERMINAL.get(result.state, "FAILED"))

    def best(self, result: TuneResult, preset: Path) -> None:
        """Tag the best trial's run; the parent gets its number, score and the preset file."""
        self.client.set_tag(self.runs[result.best_number], "sim2edge.best", "true")
        self.client.set_tag(self.ctx.parent_run_id, "sim2edge.best_trial", str(result.best_number))
        log_metrics(self.client, self.ctx.parent_run_id, {"best_eval_return": result.best_value})
        self.client.log_artifact(self.ctx.parent_run_id, str(preset))
