"""Fan-out: the flow's evaluation shards run on a local Ray cluster (prefect-ray) and give the same result."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.params import SimToEdgeParams
from registry import lineage
from stages.sim.params import PhysicalParams
from stages.twin.evaluate import EvalConfig, run_shard, shard_jobs

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
