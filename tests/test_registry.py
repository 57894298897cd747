"""Registry rules that do not need a pipeline run: who may move `champion`."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from registry import models


def test_of_two_overlapping_runs_only_one_promotes(mlflow_server):
    client = MlflowClient(mlflow_server)
    info = client.create_run(client.create_experiment("overlap-test")).info
    run, source = info.run_id, info.artifact_uri + "/bundle"
    first, second = (models.reserve_version(client, "overlap", run, source, {}) for _ in range(2))
    # both started (and were evaluated) while there was no champion; both pass their gates
    assert models.publish(client, "overlap", first, "x/bundle.tar", "0" * 64, 1, True, {}, expected_champion=None) == "champion"
    assert models.publish(client, "overlap", second, "x/bundle.tar", "0" * 64, 1, True, {}, expected_champion=None) == "challenger"
    assert client.get_model_version_by_alias("overlap", "champion").version == first
    assert "changed during this run (vNone → v1)" in client.get_model_version("overlap", second).tags["sim2edge.not_promoted"]
    third = models.reserve_version(client, "overlap", run, source, {})
    assert models.publish(client, "overlap", third, "x/bundle.tar", "0" * 64, 1, True, {}, expected_champion=first) == "champion"
