"""``nightly-retrain`` under Prefect's harness: only new telemetry, warm start, paired gate, skip when idle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.params import NightlyParams, SimToEdgeParams
from registry import lineage
from registry.telemetry import upload
from stages import standin
from stages.collect.rollouts import record
from stages.sim.registry import load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(mlflow_server):
    return MlflowClient(mlflow_server)


@pytest.fixture(scope="module")
def champion(client, prefect_harness):
    """The cart-pole champion (made here unless an earlier test module already made one)."""
    found = lineage.champion(client, "cartpole")
    if found is None:
        from flows.sim_to_edge import sim_to_edge

        sim_to_edge(SimToEdgeParams(iterations=100))
        found = lineage.champion(client, "cartpole")
    return found


def test_nightly_ingests_new_telemetry_warm_starts_and_gates_against_the_champion(client, champion, tmp_path):
    from flows.nightly import nightly_retrain

    logs = record(load("cartpole"), standin.hidden_params("cartpole"), 8, 77, tmp_path / "robot-3.parquet",
                  "stand-in:cartpole", policy_version=champion.version)
    upload(client, [logs], "cartpole", "stand-in:cartpole", champion.version)
    before = lineage.champion(client, "cartpole").version

    summary = nightly_retrain(NightlyParams(iterations=10))
    assert summary.warm_started_from == before and summary.compared_with == before
    assert any("vs champion, paired return difference" in r for r in summary.gate_reasons)
    mv = client.get_model_version("cartpole", summary.version)
    parent = client.get_run(mv.tags["sim2edge.pipeline_run_id"])
    assert parent.data.tags["sim2edge.nightly"] == "new telemetry"
    collect_run = client.search_runs([parent.info.experiment_id],
                                     f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`sim2edge.stage` = 'collect'")[0]
    ingest = json.loads(Path(client.download_artifacts(collect_run.info.run_id, "ingest_report.json", str(tmp_path))).read_text())
    assert any(p.endswith("robot-3.parquet") for p in ingest["added"])  # and any other module's uploads not yet read
    train_run = client.search_runs([parent.info.experiment_id],
                                   f"tags.mlflow.parentRunId = '{parent.info.run_id}' and tags.`sim2edge.stage` = 'train'")[0]
    assert train_run.data.params["warm_start"].endswith("model.pt")
    expected = "champion" if all(r.startswith("pass") for r in summary.gate_reasons) else "challenger"
    assert summary.alias == expected

    aliases = client.get_registered_model("cartpole").aliases
    versions = {v.version for v in client.search_model_versions("name='cartpole'")}
    assert nightly_retrain(NightlyParams(iterations=10)) is None  # nothing new: skipped
    assert client.get_registered_model("cartpole").aliases == aliases
    assert {v.version for v in client.search_model_versions("name='cartpole'")} == versions
