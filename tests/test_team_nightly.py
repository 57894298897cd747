"""The nightly deployment served by a worker process against the team stack on PostgreSQL: `sim2edge up --database
postgresql://…` (Debian's PostgreSQL, started by the test as its own process); one `sim2edge run` of the tiny
cart-pole task (tests/test_team_runs.py), installed as the team's own package would be (a ``sim2edge.tasks`` entry
point: a deployment's parameter form takes registered names only, so ``module:Class`` is refused there), makes the
champion from a laptop's workspace; `sim2edge deploy --pool` registers prefect.yaml's deployments on a process work
pool of that Prefect server; a real `prefect worker start` process, from a workspace of its own (its own dataset store
and keys: it reaches the champion only through the servers), picks up a `nightly-retrain` flow run triggered from the
deployment (`prefect deployment run`) after a device uploaded telemetry for the champion's policy, and runs it to
Completed. Read back from PostgreSQL: the flow run, its
deployment and work pool in ``<db>_prefect``; the new version, warm-started from and gated against the champion with
its nightly lineage, in ``<db>_mlflow``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from registry.telemetry import upload
from stages import standin
from stages.collect.rollouts import record
from stages.sim.registry import load
from tests.conftest import free_port
from tests.servers import wait_up
from tests.test_team_runs import REPO, SIM2EDGE, TASK, TINY, clean_env
from tests.test_up_postgres import pytestmark as needs_postgres
from tests.test_up_postgres import postgres, rows  # noqa: F401  (postgres: the fixture)
from tests.test_up_ports import none_left

pytestmark = [pytest.mark.slow, needs_postgres]
POOL = "team-process"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def stop(p: subprocess.Popen, timeout: float = 60) -> None:
    """SIGINT ``p``'s process group (it was started in its own session), then SIGKILL it if it lingers."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def test_nightly_deployment_runs_on_a_worker_against_the_postgresql_team_stack(postgres, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    server_home, mlflow_port, prefect_port = tmp_path / "server", free_port(), free_port()
    mlflow_url, prefect_api = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}/api"
    (tmp_path / "tiny.yaml").write_text(TINY)
    (tmp_path / "team_task.py").write_text(TASK)
    plugin = tmp_path / "team_task-1.0.dist-info"  # the team's package, as pip would have installed it
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: team-task\nVersion: 1.0\n")
    (plugin / "entry_points.txt").write_text("[sim2edge.tasks]\nteamcart = team_task:TeamCart\n")
    for who in ("alice", "ops", "worker"):
        (tmp_path / who).mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([SIM2EDGE, "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                               "--database", f"postgresql://postgres@127.0.0.1:{postgres}/night"],
                              env=clean_env(SIM2EDGE_HOME=str(server_home)), stdout=out, stderr=subprocess.STDOUT)

    def env(who: str) -> dict[str, str]:
        return clean_env(SIM2EDGE_HOME=str(tmp_path / who), MLFLOW_TRACKING_URI=mlflow_url, PREFECT_API_URL=prefect_api,
                         PREFECT_HOME=str(tmp_path / who / "prefect-cli"), OMP_NUM_THREADS="1",
                         PYTHONPATH=f"{REPO}:{tmp_path}")

    worker = None
    worker_log = tmp_path / "worker.log"
    state, run_id = None, None
    try:
        wait_up(up, log)
        # the champion, from a laptop
        made = subprocess.run([SIM2EDGE, "run", "--config", str(tmp_path / "tiny.yaml"), "--task", "teamcart"],
                              env=env("alice"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert made.returncode == 0, made.stdout[-3000:]
        client = MlflowClient(mlflow_url)
        champion = client.get_model_version_by_alias("teamcart", "champion").version

        deployed = subprocess.run([SIM2EDGE, "deploy", "--pool", POOL], env=env("ops"), capture_output=True, text=True,
                                  timeout=300)
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]

        with worker_log.open("wb") as out:
            worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
                                      cwd=tmp_path, env=env("worker"), stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)

        # a device's telemetry, flown under the champion
        logs = record(load("team_task:TeamCart"), standin.hidden_params("teamcart"), 4, 77,
                      tmp_path / "robot-7.parquet", "robot-7", policy_version=champion)
        upload(client, [logs], "teamcart", "robot-7", champion)

        tiny = yaml.safe_load(TINY)
        tiny.pop("collect_episodes")
        params = {"params": {**tiny, "task": "teamcart"}}  # a registered name: the form's picker lists no other
        triggered = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "nightly-retrain/nightly-retrain",
                                    "--params", json.dumps(params)], env=env("ops"), capture_output=True, text=True,
                                   timeout=120)
        assert triggered.returncode == 0, triggered.stdout[-3000:] + triggered.stderr[-3000:]
        (run_id,) = [line.split()[-1] for line in triggered.stdout.splitlines() if "UUID" in line]

        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            (state,) = rows(postgres, "night_prefect", f"SELECT state_type FROM flow_run WHERE id = '{run_id}'")
            if state[0] in TERMINAL:
                break
            assert worker.poll() is None, worker_log.read_text()[-3000:]
            time.sleep(2)
    finally:
        if worker is not None:
            stop(worker)
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert state == ("COMPLETED",), (state, worker_log.read_text()[-4000:])
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(server_home) and none_left(tmp_path / "worker")

    # Prefect, on PostgreSQL: the flow run came from the nightly deployment, on the process pool, through a worker
    ((flow, deployment, pool, work_queue, worker_type),) = rows(postgres, "night_prefect", f"""
        SELECT f.name, d.name, wp.name, fr.work_queue_name, wp.type FROM flow_run fr
        JOIN flow f ON fr.flow_id = f.id JOIN deployment d ON fr.deployment_id = d.id
        JOIN work_queue wq ON fr.work_queue_id = wq.id JOIN work_pool wp ON wq.work_pool_id = wp.id
        WHERE fr.id = '{run_id}'""")
    assert (flow, deployment, pool, worker_type) == ("nightly-retrain", "nightly-retrain", POOL, "process")
    workers = rows(postgres, "night_prefect", f"SELECT w.name FROM worker w JOIN work_pool wp ON w.work_pool_id = wp.id "
                                              f"WHERE wp.name = '{POOL}'")
    assert workers, "no worker ever polled the pool"
    ((pid,),) = rows(postgres, "night_prefect", f"SELECT infrastructure_pid FROM flow_run WHERE id = '{run_id}'")
    assert pid, "the flow run names no process the worker started"
    states = [s for (s,) in rows(postgres, "night_prefect", f"SELECT type FROM flow_run_state "
                                                            f"WHERE flow_run_id = '{run_id}' ORDER BY timestamp")]
    assert states[0] == "SCHEDULED" and "PENDING" in states and "RUNNING" in states and states[-1] == "COMPLETED", states

    # MLflow, on PostgreSQL: a second version, warm-started from and gated against the champion, with its lineage
    versions = rows(postgres, "night_mlflow", "SELECT version, status FROM model_versions WHERE name = 'teamcart' "
                                              "ORDER BY version")
    assert versions == [(1, "READY"), (2, "READY")], versions
    assert str(champion) == "1"
    tags = dict(rows(postgres, "night_mlflow", "SELECT key, value FROM model_version_tags "
                                               "WHERE name = 'teamcart' AND version = 2"))
    assert tags["sim2edge.gate"] in ("pass", "fail"), tags
    parent = tags["sim2edge.pipeline_run_id"]
    run_tags = dict(rows(postgres, "night_mlflow", f"SELECT key, value FROM tags WHERE run_uuid = '{parent}'"))
    assert run_tags["sim2edge.flow"] == "nightly-retrain" and run_tags["sim2edge.nightly"] == "new telemetry", run_tags
    (status,) = rows(postgres, "night_mlflow", f"SELECT status FROM runs WHERE run_uuid = '{parent}'")
    assert status == ("FINISHED",)
    stages = dict(rows(postgres, "night_mlflow", f"""
        SELECT s.value, r.run_uuid FROM runs r JOIN tags p ON p.run_uuid = r.run_uuid AND p.key = 'mlflow.parentRunId'
        JOIN tags s ON s.run_uuid = r.run_uuid AND s.key = 'sim2edge.stage' WHERE p.value = '{parent}'"""))
    assert {"collect", "calibrate", "train"} <= set(stages), stages
    (warm,) = rows(postgres, "night_mlflow", f"SELECT value FROM params WHERE run_uuid = '{stages['train']}' "
                                             f"AND key = 'warm_start'")
    assert warm[0].endswith("model.pt"), warm
    metrics = dict(rows(postgres, "night_mlflow", f"SELECT key, value FROM latest_metrics WHERE run_uuid = '{parent}'"))
    assert {"champion_mean_return", "champion_success_rate", "gate_passed"} <= set(metrics), metrics  # paired vs v1
    aliases = dict(rows(postgres, "night_mlflow", "SELECT alias, version FROM registered_model_aliases "
                                                  "WHERE name = 'teamcart'"))
    assert aliases == ({"champion": 2} if tags["sim2edge.gate"] == "pass" else {"champion": 1, "challenger": 2}), \
        (aliases, tags)
    assert not list(tmp_path.glob("*/mlflow/*.db"))  # no workspace kept a registry of its own
