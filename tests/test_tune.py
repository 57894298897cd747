"""``sim2edge tune``: an Optuna search over cart-pole's PPO settings, its pruning, the preset it writes, the ``tune``
flow running trials two at a time, and the CLI."""

from __future__ import annotations

import asyncio

import optuna
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from typer.testing import CliRunner

from flows.cli import app
from flows.run_config import resolve
from stages.train_config import TrainConfig
from flows.tune_flow import TuneParams, search, tune as tune_flow
from stages.tune import TuneConfig, tune, write_preset

TINY = TuneConfig(task="cartpole", trials=3, iterations=4, eval_every=2, eval_episodes=4,
                  envs_steps=((16, 16), (32, 8)), hidden_dims=((16, 16), (32,)), nthread=1)


class Recorded:
    """A TrialLog that keeps what it is told."""

    def __init__(self) -> None:
        self.started, self.steps, self.finished = [], [], []

    def start(self, number, params):
        self.started.append(number)

    def step(self, number, step, eval_return):
        self.steps.append((number, step))

    def finish(self, result):
        self.finished.append(result.state)


@pytest.fixture(scope="module")
def searched():
    log = Recorded()
    return tune(TINY, log=log), log


def test_search_scores_each_trial_and_keeps_the_best(searched):
    result, log = searched
    assert len(result.trials) == 3 and log.started == [0, 1, 2] and log.finished == [t.state for t in result.trials]
    complete = [t for t in result.trials if t.state == "COMPLETE"]
    assert complete and result.best_value == max(t.value for t in complete)
    assert result.best_params == next(t.params for t in complete if t.number == result.best_number)
    assert {s for n, s in log.steps if n == 0} == {2, 4}  # eval_return at every eval_every iterations


def test_best_config_is_a_run_configuration(searched, tmp_path):
    result, _ = searched
    params = resolve("cartpole", write_preset(tmp_path / "tuned.yaml", result, TINY), [], {}).model_dump()
    best = dict(result.best_params)
    assert params["num_envs"] == best.pop("num_envs")
    assert {k: params["train"][k] for k in best} == best  # hidden_dims: a tuple both sides


def test_a_trial_below_the_threshold_is_pruned_at_its_first_evaluation():
    log = Recorded()
    with pytest.raises(ValueError, match=r"no trial completed \(0: PRUNED\)"):
        tune(TINY.model_copy(update={"trials": 1}), log=log, pruner=optuna.pruners.ThresholdPruner(lower=1e9))
    assert log.finished == ["PRUNED"] and log.steps == [(0, 2)]


def test_a_trial_stopped_by_its_minutes_between_evaluations_is_scored_on_its_final_policy():
    log = Recorded()
    result = tune(TINY.model_copy(update={"trials": 1, "iterations": 1000, "eval_every": 500,
                                          "minutes_per_trial": 0.02}), log=log)
    (number, step), = log.steps
    assert result.trials[0].state == "COMPLETE" and number == 0 and step < 500


async def task_runs(flow_run_id) -> dict:
    async with get_client() as client:
        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return {r.name: r for r in runs}


def test_flow_runs_trials_two_at_a_time_and_writes_the_best(prefect_harness, tmp_path):
    out = tmp_path / "tuned.yaml"
    state = tune_flow(TuneParams(search=TINY.model_copy(update={"trials": 4}), parallel=2, out=str(out)),
                      return_state=True)
    summary = state.result()
    result = summary.result
    assert [t.number for t in result.trials] == [0, 1, 2, 3]
    assert {t.state for t in result.trials} <= {"COMPLETE", "PRUNED"}
    assert result.best_value == max(t.value for t in result.trials if t.state == "COMPLETE")
    assert summary.preset == str(out)
    params = resolve("cartpole", out, [], {}).model_dump()
    assert params["num_envs"] == result.best_params["num_envs"]
    assert params["train"]["learning_rate"] == result.best_params["learning_rate"]
    runs = asyncio.run(task_runs(state.state_details.flow_run_id))
    assert sorted(runs) == ["trial 0", "trial 1", "trial 2", "trial 3"]
    assert runs["trial 1"].start_time < runs["trial 0"].end_time  # the first two ran at once


@flow
def searched_in_a_flow(cfg: TuneConfig, parallel: int, storage: str) -> list[str]:
    study = search(cfg, TrainConfig(task=cfg.task), Recorded(), parallel, storage,
                   optuna.pruners.ThresholdPruner(lower=1e9))
    return [t.state.name for t in study.trials]


def test_flow_tells_a_pruned_trial_pruned(prefect_harness, tmp_path):
    states = searched_in_a_flow(TINY.model_copy(update={"trials": 2}), 2, str(tmp_path / "study.journal"))
    assert states == ["PRUNED", "PRUNED"]


def test_cli_bad_task_is_one_line():
    done = CliRunner().invoke(app, ["tune", "--task", "nosuch"], env={"COLUMNS": "200"})
    assert done.exit_code == 2 and "Traceback" not in done.output
    assert done.output.strip().splitlines() == [done.output.strip()] and "nosuch" in done.output


def test_cli_refuses_a_study_storage_it_cannot_open_in_one_line_before_logging(prefect_harness, tmp_path):
    home = tmp_path / "home"
    done = CliRunner().invoke(app, ["tune", "--task", "cartpole", "--trials", "1", "--storage", "bogus://nowhere"],
                              env={"SIM2EDGE_HOME": str(home), "MLFLOW_TRACKING_URI": None, "COLUMNS": "200"})
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    assert done.output.strip().splitlines() == [done.output.strip()] and "bogus://nowhere" in done.output
    assert not (home / "tune").exists()


def test_cli_logs_one_mlflow_run_per_trial_and_tags_the_best(prefect_harness, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "tuned.yaml"
    done = CliRunner().invoke(app, ["tune", "--task", "cartpole", "--trials", "2", "--iterations", "2", "--eval-every",
                                    "2", "--eval-episodes", "2", "--parallel", "2", "--out", str(out)],
                              env={"SIM2EDGE_HOME": str(tmp_path / "home"), "MLFLOW_TRACKING_URI": None,
                                   "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert resolve(None, out, [], {}).task == "cartpole" and f"sim2edge run --config {out}" in done.output
    client = MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("sim2edge/cartpole").experiment_id])
    parent = next(r for r in runs if r.info.run_name == "tune")
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    best = [r for r in trials if r.data.tags.get("sim2edge.best") == "true"]
    assert len(trials) == 2 and len(best) == 1 and parent.info.status == "FINISHED"
    assert best[0].info.run_name == f"trial-{parent.data.tags['sim2edge.best_trial']}"
    assert best[0].data.metrics["score"] == parent.data.metrics["best_eval_return"]


@pytest.mark.parametrize("name", ["pusher_reach", "examples.gym_pusher:PusherReach", "Arm 6 (v2)"])
def test_artifact_keys_from_any_task_name_are_keys_prefect_takes(name):
    """`sim2edge tune` of `pusher_reach` failed after its last trial: Prefect refuses an underscore in a key."""
    from prefect.artifacts import TableArtifact

    from flows.artifact_keys import artifact_key

    key = artifact_key("tune", name)
    assert TableArtifact(key=key, table=[]).key == key and key.startswith("tune-") and "--" not in key
