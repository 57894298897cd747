"""Killing the pipeline mid-run (SIGKILL during training) corrupts nothing; the next run cleans up and completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_sigkill_during_training_then_the_next_run(tmp_path):
    home = tmp_path / "ws"
    env = {**os.environ, "SIM2EDGE_HOME": str(home), "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect" / "storage")}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        env.pop(var, None)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "run", "--iterations", "400"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    # no MLflow client here while the run writes: a second client would race its database migration
    while not list((home / "runs").glob("*/twin/twin.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    time.sleep(8)  # well into 400 training iterations
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    client = MlflowClient(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sim2edge/cartpole").experiment_id
    (train,) = client.search_runs([experiment], "tags.`sim2edge.stage` = 'train'")
    assert client.get_metric_history(train.info.run_id, "mean_return")  # killed mid-training
    killed = train.data.tags["mlflow.parentRunId"]
    assert client.get_run(killed).info.status == "RUNNING"  # nobody could mark it
    outputs = home / "runs" / killed
    assert sorted(p.name for p in outputs.iterdir()) == ["twin"]  # only finished stages wrote anything
    assert {p.name for p in (outputs / "twin").iterdir()} == {"twin.json", "twin.xml", "replay.png"}

    again = run_cli("sim2edge", "run", "--iterations", "2", "--eval-episodes", "4", env=env,
                    unset=("MLFLOW_TRACKING_URI", "PREFECT_API_URL"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    parent = client.get_run(killed)
    assert parent.info.status == "FAILED" and "ended without finishing" in parent.data.tags["sim2edge.failure"]
    assert client.get_run(train.info.run_id).info.status == "FAILED"
    assert not [p for p in outputs.rglob(".*")]
    assert (home / "datasets" / "cartpole" / "latest").read_text().strip() == "v0001"
