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


def test_a_create_retried_after_its_answer_was_lost_leaves_no_duplicate(mlflow_server):
    """The MLflow client retries a POST whose answer a killed server never sent; the retry makes a second version
    with the same reservation token, which ``reserve_version`` finds and deletes (tests/test_team_restart.py kills
    the real server)."""
    client = MlflowClient(mlflow_server)
    info = client.create_run(client.create_experiment("retried-create")).info
    real_create = client.create_model_version
    calls = []

    def create_twice(*args, **kwargs):  # the request committed, its answer lost, the client's retry committed again
        calls.append(real_create(*args, **kwargs))
        return real_create(*args, **kwargs)

    client.create_model_version = create_twice
    version = models.reserve_version(client, "retried", info.run_id, info.artifact_uri + "/bundle", {})
    kept = client.search_model_versions("name = 'retried'")
    assert [str(v.version) for v in kept] == [version] == ["2"] and len(calls) == 1
    assert kept[0].tags[models.TAG_RESERVATION]
    other = models.reserve_version(client, "retried", info.run_id, info.artifact_uri + "/bundle", {})
    assert sorted(str(v.version) for v in client.search_model_versions("name = 'retried'")) == ["2", "4"]
    assert other == "4"
