"""MLflow logging of ``sim2edge tune``: one nested run per Optuna trial under the search's parent run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from registry.tracking import OWNER, RunContext, log_metrics, log_params, owner
from stages.tune import TrialResult, TuneResult

TRIAL = "sim2edge.trial"
"""The tag holding a trial run's trial number."""

TERMINAL = {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}
"""MLflow's run status for an Optuna trial state (anything else: FAILED)."""


class MlflowTrials:
    """A :class:`stages.tune.TrialLog`: one nested MLflow run per trial (tagged with its number), ``eval_return`` at
    each evaluation. It holds the run context and a cache of run ids only, so a trial's process (a Ray worker) logs
    through its own copy and the flow finds the run by its tag."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.runs = ctx, {}

    def run_of(self, number: int) -> str | None:
        """The MLflow run of trial ``number`` (None before it started)."""
        if number not in self.runs:
            found = self.ctx.client.search_runs(
                [self.ctx.experiment_id], f"tags.`{TRIAL}` = '{number}' and tags.`mlflow.parentRunId` = "
                                          f"'{self.ctx.parent_run_id}'")
            if found:
                self.runs[number] = found[0].info.run_id
        return self.runs.get(number)

    def start(self, number: int, params: dict[str, Any]) -> None:
        run = self.ctx.client.create_run(self.ctx.experiment_id, run_name=f"trial-{number}",
                                         tags={"mlflow.parentRunId": self.ctx.parent_run_id, OWNER: owner(),
                                               "sim2edge.stage": "tune-trial", TRIAL: str(number)})
        self.runs[number] = run.info.run_id
        log_params(self.ctx.client, run.info.run_id, params)

    def step(self, number: int, step: int, eval_return: float) -> None:
        log_metrics(self.ctx.client, self.run_of(number), {"eval_return": eval_return}, step)

    def finish(self, result: TrialResult) -> None:
        run_id = self.run_of(result.number)
        if run_id is None:  # failed before its training started
            return
        client = self.ctx.client
        client.set_tag(run_id, "sim2edge.trial_state", result.state)
        if result.value is not None:
            log_metrics(client, run_id, {"score": result.value})
        client.set_terminated(run_id, TERMINAL.get(result.state, "FAILED"))

    def best(self, result: TuneResult, preset: Path) -> None:
        """Tag the best trial's run; the parent gets its number, score and the preset file."""
        client = self.ctx.client
        client.set_tag(self.run_of(result.best_number), "sim2edge.best", "true")
        client.set_tag(self.ctx.parent_run_id, "sim2edge.best_trial", str(result.best_number))
        log_metrics(client, self.ctx.parent_run_id, {"best_eval_return": result.best_value})
        client.log_artifact(self.ctx.parent_run_id, str(preset))
