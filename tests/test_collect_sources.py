"""Collect from the registry (device telemetry runs) and the standalone collect/calibrate commands."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from mlflow.tracking import MlflowClient

from flows.steps import collect_step
from flows.workspace import Workspace
from registry.telemetry import upload
from registry.tracking import standalone
from stages import logs, standin
from stages.collect.rollouts import record
from stages.sim.registry import load
from tests.conftest import run_cli


def _collect_runs(client: MlflowClient, experiment_id: str):
    return client.search_runs([experiment_id], "tags.`sim2edge.stage` = 'collect'", order_by=["attributes.start_time DESC"])


def test_registry_telemetry_ingests_only_what_is_new(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    ws = Workspace(home=tmp_path / "ws")
    task, hidden = load("cartpole"), standin.hidden_params("cartpole")
    first = record(task, hidden, 2, 11, tmp_path / "robot7-a.parquet", "robot-7", policy_version="3")
    upload(client, [first], "cartpole", "robot-7", "3")
    ctx = standalone(mlflow_server, "sim2edge/cartpole-telemetry-test", None)

    one = collect_step(ctx, ws, "cartpole", "registry")
    assert [p.rsplit("/", 1)[-1] for p in one.added] == ["robot7-a.parquet"] and one.dataset.version == 1
    again = collect_step(ctx, ws, "cartpole", "registry")
    assert again.added == () and not again.new_version and again.dataset == one.dataset

    second = record(task, hidden, 2, 12, tmp_path / "robot7-b.parquet", "robot-7", policy_version="4")
    bad = tmp_path / "robot7-nan.parquet"
    table = pq.read_table(second)
    values = table.column("qvel.0").to_numpy().copy()
    values[3] = np.nan
    logs.write(table.set_column(table.column_names.index("qvel.0"), "qvel.0", pa.array(values)), bad)
    upload(client, [second, bad], "cartpole", "robot-7", "4")
    two = collect_step(ctx, ws, "cartpole", "registry")
    assert [p.rsplit("/", 1)[-1] for p in two.added] == ["robot7-b.parquet"] and two.dataset.version == 2
    (q,) = two.quarantined
    assert "robot7-nan.parquet: episode 0, column 'qvel.0', row 3" in q.reason

    run = _collect_runs(client, ctx.experiment_id)[0]
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "cartpole-v0002" and inp.dataset.digest == two.dataset.digest[:32]
    assert {t.key: t.value for t in inp.tags}["sim2edge.dataset_digest"] == two.dataset.digest
    assert run.data.metrics["quarantined_files"] == 1 and run.data.tags["sim2edge.robots"] == "robot-7"


def test_collect_and_calibrate_commands(tmp_path):
    env = {"SIM2EDGE_HOME": str(tmp_path / "ws"), "COLUMNS": "160"}
    unset = ("MLFLOW_TRACKING_URI",)
    out = run_cli("sim2edge", "collect", "--task", "cartpole", "--episodes", "6", env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "dataset cartpole v0001 (new): 6 episodes, 1500 rows" in out.stdout

    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "cut.parquet").write_bytes(b"PAR1 not really")
    out = run_cli("sim2edge", "collect", "--task", "cartpole", "--source", "folder", "--folder", str(uploads),
                  env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "quarantined" in out.stdout and "cut.parquet" in out.stdout and "unchanged" in out.stdout

    out = run_cli("sim2edge", "calibrate", "--task", "cartpole", "--generations", "12", "--max-latency", "0",
                  env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "stand-in truth" in out.stdout and "replay error" in out.stdout
    assert (tmp_path / "ws" / "twins" / "cartpole" / "v0001" / "twin.json").exists()

    out = run_cli("sim2edge", "calibrate", "--task", "cartpole", "--dataset", "v0007", env=env, unset=unset)
    assert out.returncode == 2 and "no dataset version 'v0007'" in out.stdout and "versions: v0001" in out.stdout
    out = run_cli("sim2edge", "collect", "--task", "nope", env=env, unset=unset)
    assert out.returncode == 2 and "valid tasks: cartpole, reacher" in out.stdout
