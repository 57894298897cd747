"""Stage caching: an unchanged re-run reuses finished stages; a run that failed at evaluation resumes there.
A diverging training run stops with a clear error and leaves its last good checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.params import SimToEdgeParams
from stages.sim.cartpole import CartPole
from stages.sim.params import PhysicalParams
from stages.train import NonFiniteTraining, load_actor, train
from stages.train_config import TrainConfig

PARAMS = SimToEdgeParams(iterations=4, num_envs=32, eval_episodes=8, seed=11)


def _stage_runs(client: MlflowClient, parent_id: str) -> set[str]:
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name for r in runs}


def _latest_parent(client: MlflowClient) -> str:
    experiment = client.get_experiment_by_name("sim2edge/cartpole").experiment_id
    runs = client.search_runs([experiment], "tags.`sim2edge.task` = 'cartpole'", order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id


@pytest.mark.slow
def test_failed_evaluation_resumes_without_retraining(mlflow_server, prefect_harness, monkeypatch):
    import flows.stage_tasks as stage_tasks
    from flows.sim_to_edge import sim_to_edge

    client = MlflowClient(mlflow_server)
    real = stage_tasks.evaluate

    def broken(*args, **kwargs):
        raise RuntimeError("injected evaluation failure")

    monkeypatch.setattr(stage_tasks, "evaluate", broken)
    with pytest.raises(RuntimeError, match="injected evaluation failure"):
        sim_to_edge(PARAMS)
    failed = _latest_parent(client)
    assert client.get_run(failed).info.status == "FAILED"
    assert {"calibrate", "train", "export", "evaluate"} <= _stage_runs(client, failed)

    monkeypatch.setattr(stage_tasks, "evaluate", real)
    resumed = sim_to_edge(PARAMS)
    tags = client.get_run(resumed.mlflow_run_id).data.tags
    assert tags["sim2edge.reused.train"] == tags["sim2edge.reused.export"] == tags["sim2edge.reused.calibrate"] == failed
    assert "sim2edge.reused.evaluate" not in tags
    assert _stage_runs(client, resumed.mlflow_run_id) == {"collect", "evaluate", "package", "register"}

    again = sim_to_edge(PARAMS)
    tags = client.get_run(again.mlflow_run_id).data.tags
    assert tags["sim2edge.reused.evaluate"] == resumed.mlflow_run_id and tags["sim2edge.reused.train"] == failed
    assert again.success_rate == resumed.success_rate and again.version != resumed.version
    assert again.stage_seconds["train"] < 5


@pytest.mark.slow
def test_only_network_and_registry_failures_are_retried():
    from mlflow.exceptions import MlflowException
    from prefect.states import Failed

    from flows.stage_tasks import transient

    assert transient(None, None, Failed(data=ConnectionError("connection refused")))
    assert transient(None, None, Failed(data=MlflowException("API request failed: Max retries exceeded with url")))
    assert not transient(None, None, Failed(data=ValueError("no dataset for task 'cartpole'")))
    assert not transient(None, None, Failed(data=MlflowException("RESOURCE_DOES_NOT_EXIST", error_code="RESOURCE_DOES_NOT_EXIST")))


@pytest.mark.slow
def test_training_seeds_fan_out_and_the_best_is_exported(mlflow_server, prefect_harness, tmp_path):
    import json

    from flows.sim_to_edge import sim_to_edge
    from registry import lineage

    client = MlflowClient(mlflow_server)
    summary = sim_to_edge(SimToEdgeParams(iterations=3, num_envs=16, train_seeds=2, eval_episodes=4, seed=31))
    parent = client.get_run(summary.mlflow_run_id)
    finals = json.loads(parent.data.tags["sim2edge.train_seeds"])
    trains = client.search_runs([parent.info.experiment_id],
                                f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`sim2edge.stage` = 'train'")
    assert sorted(r.data.params["seed"] for r in trains) == sorted(finals) == ["31", "32"]
    chosen = client.get_run(parent.data.tags["sim2edge.stage_run.train"])
    assert chosen.data.params["seed"] == max(finals, key=finals.get)
    version = client.get_model_version("cartpole", summary.version)
    ckpt = lineage.stage_artifact(client, version, "train", "checkpoint/model.pt", tmp_path)
    import torch

    assert torch.load(ckpt, weights_only=False)["infos"]["config"]["seed"] == int(chosen.data.params["seed"])


TINY = TrainConfig(iterations=5, num_envs=8, steps_per_env=8, hidden_dims=(16,))


@dataclass(frozen=True)
class Diverging(CartPole):
    """Cart-pole whose reward turns NaN after ``healthy_steps`` control steps (a blown-up reward term)."""

    healthy_steps: int = 2 * TINY.steps_per_env
    calls: list = field(default_factory=lambda: [-1])  # registration's check calls reward() once

    def reward(self, qpos, qvel, action):
        self.calls[0] += 1
        r = super().reward(qpos, qvel, action)
        return r * np.nan if self.calls[0] > self.healthy_steps else r


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(own_task, tmp_path):
    own_task("diverging", Diverging)
    with pytest.raises(NonFiniteTraining, match=r"iteration 2: training diverged .* last good checkpoint \(after 2 "
                                                r"iterations\) is .*model.pt"):
        train(TINY.model_copy(update={"task": "diverging"}), PhysicalParams(), tmp_path / "diverged")
    saved = torch.load(tmp_path / "diverged" / "model.pt", weights_only=False)
    assert saved["iter"] == 2
    healthy = train(TINY.model_copy(update={"iterations": 2}), PhysicalParams(), tmp_path / "healthy")
    reference = torch.load(healthy.path, weights_only=False)["actor_state_dict"]
    assert all(torch.equal(saved["actor_state_dict"][k], reference[k]) for k in reference)  # the state before the NaN
    assert all(torch.isfinite(p).all() for p in load_actor(tmp_path / "diverged" / "model.pt").parameters())
