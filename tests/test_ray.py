"""Fan-out on a local Ray cluster (prefect-ray): the flow's evaluation shards give the same result; tuning trials
report to the flow's study."""

from __future__ import annotations

import json

import optuna
import pytest
from mlflow.tracking import MlflowClient

from flows.params import SimToEdgeParams
from registry import lineage
from stages.sim.params import PhysicalParams
from stages.twin.evaluate import EvalConfig, run_shard, shard_jobs
from stages.tune import TuneConfig, study_storage

pytestmark = pytest.mark.slow


def test_evaluation_shards_run_on_a_local_ray_cluster(mlflow_server, prefect_harness, tmp_path):
    import ray
    from prefect_ray import RayTaskRunner

    from flows.sim_to_edge import sim_to_edge

    params = SimToEdgeParams(iterations=2, num_envs=16, eval_episodes=12, seed=12)  # no cache shared with other tests
    runner = RayTaskRunner(init_kwargs={"num_cpus": 2, "include_dashboard": False})
    summary = sim_to_edge.with_options(task_runner=runner)(params)
    assert not ray.is_initialized()  # the runner started its own local cluster and shut it down

    client = MlflowClient(mlflow_server)
    version = client.get_model_version("cartpole", summary.version)
    onnx = lineage.stage_artifact(client, version, "export", "onnx/policy.onnx", tmp_path / "onnx")
    twin = json.loads(lineage.stage_artifact(client, version, "calibrate", "twin/twin.json", tmp_path / "twin").read_text())
    cfg = EvalConfig(episodes=12, seed=params.seed + 1000)
    local = [run_shard(job, "cartpole", PhysicalParams(**twin["params"])) for job in shard_jobs(cfg, cfg.load_suite("cartpole"), onnx)]
    returns = [r for shard in local if shard.scenario == "nominal" for r in shard.returns]
    assert summary.mean_return == pytest.approx(sum(returns) / len(returns), rel=1e-9)


def test_tune_trials_run_on_a_local_ray_cluster_and_report_to_the_flows_study(prefect_harness, tmp_path, monkeypatch):
    import ray
    from prefect_ray import RayTaskRunner

    from flows.tune_flow import TuneParams, tune

    home = tmp_path / "home"
    monkeypatch.setenv("SIM2EDGE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = TuneConfig(task="cartpole", trials=3, iterations=4, eval_every=2, eval_episodes=4,
                     envs_steps=((16, 16),), hidden_dims=((16, 16), (32,)), nthread=1)
    runner = RayTaskRunner(init_kwargs={"num_cpus": 2, "include_dashboard": False})
    summary = tune.with_options(task_runner=runner)(TuneParams(search=cfg, parallel=2, out=str(tmp_path / "t.yaml")))
    assert not ray.is_initialized()  # the runner started its own local cluster and shut it down

    (journal,) = (home / "tune").glob("*.journal")
    study = optuna.load_study(study_name="tune", storage=study_storage(str(journal)))
    assert [t.number for t in study.trials] == [0, 1, 2]
    for t in study.trials:  # each worker's evaluations reached the flow's study through the journal
        assert t.state.name in ("COMPLETE", "PRUNED") and 2 in t.intermediate_values
    client = MlflowClient(summary.tracking_uri)
    parent = client.get_run(summary.mlflow_run_id)
    trials = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in trials) == ["trial-0", "trial-1", "trial-2"]
    assert all(r.info.status in ("FINISHED", "KILLED") and "eval_return" in r.data.metrics for r in trials)
    best = next(r for r in trials if r.data.tags.get("sim2edge.best") == "true")
    assert best.data.metrics["score"] == summary.result.best_value
