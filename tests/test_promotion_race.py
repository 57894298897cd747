"""Two runs that finish together, as two real processes against one MLflow server and one Prefect API:
both are held after reading the champion until the other has read it too (or 5 s have passed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.promotion import promote_slot
from registry import models

HOLD_S = 5
PROMOTE = """
import sys
from mlflow.tracking import MlflowClient
from flows.promotion import promote_slot
from flows.promotion import promote_slot
from registry import models
with promote_slot("race"):
    print(models.publish(MlflowClient(), "race", sys.argv[1], "x/bundle.tar", "0" * 64, 1, True, {}, None))
"""


def test_two_runs_promoting_at_once_leave_one_champion(mlflow_server, prefect_harness, tmp_path):
    client = MlflowClient(mlflow_server)
    info = client.create_run(client.create_experiment("race-test")).info
    versions = [models.reserve_version(client, "race", info.run_id, info.artifact_uri + "/bundle", {}) for _ in range(2)]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "MLFLOW_TRACKING_URI": mlflow_server, models.BARRIER_ENV: f"{barrier}:2:{HOLD_S}"}
    procs = [subprocess.Popen([sys.executable, "-c", PROMOTE, v], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for v in versions]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    aliases = {v: out.strip().splitlines()[-1] for v, (out, _) in zip(versions, outs)}
    assert len(os.listdir(barrier)) == 2  # both reached the point between reading the champion and moving it
    assert sorted(aliases.values()) == ["challenger", "champion"], aliases
    champion = client.get_model_version_by_alias("race", "champion").version
    (loser,) = set(versions) - {champion}
    assert aliases[champion] == "champion"
    assert client.get_model_version_by_alias("race", "challenger").version == loser
    assert client.get_model_version("race", loser).tags["sim2edge.not_promoted"] == \
        f"the champion changed during this run (vNone → v{champion})"


def test_the_promote_slot_is_created_once_and_then_only_looked_up(prefect_harness, monkeypatch):
    """A second run does not try to create the existing limit (the server would log a database traceback)."""
    from prefect.client.orchestration import SyncPrefectClient

    created: list[str] = []
    create = SyncPrefectClient.create_global_concurrency_limit
    monkeypatch.setattr(SyncPrefectClient, "create_global_concurrency_limit",
                        lambda self, limit: created.append(limit.name) or create(self, limit))
    for _ in range(2):
        with promote_slot("once"):
            pass
    assert created == ["promote-once"]
