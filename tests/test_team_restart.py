"""A server restart in the middle of a run on the team stack: the run rides it out, nothing is half-registered.

`sim2edge up --database postgresql://…` (Debian's PostgreSQL, the test's own process) and one `sim2edge run` of
tests/test_team_runs.py's tiny cart-pole against it. The moment the registry shows the run's model version (the
``package`` stage has reserved it and is uploading the bundle; ``register`` tags it and moves the aliases next),
MLflow's or Prefect's server is SIGKILLed with its workers, as an OOM kill would; `up` starts it again. The run
must finish on its clients' retries, and the registry, read straight from PostgreSQL once the servers stopped,
must hold no version without its bundle, lineage and gate tags, with the champion on a complete version. A second
run afterwards registers normally.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from mlflow.tracking import MlflowClient

from registry import models
from tests.conftest import free_port
from tests.servers import wait_up
from tests.test_team_runs import REPO, SIM2EDGE, TASK, TINY, clean_env
from tests.test_up_postgres import pytestmark as needs_postgres
from tests.test_up_postgres import postgres, rows  # noqa: F401  (postgres: the fixture)
from tests.test_up_ports import none_left
from tests.test_up_restart import server_group

pytestmark = [pytest.mark.slow, needs_postgres]
COMPLETE = {models.TAG_PATH, models.TAG_SHA256, "sim2edge.dataset_digest", "sim2edge.twin_digest",
            "sim2edge.pipeline_run_id", "sim2edge.gate"}
"""Tags a registered version carries once ``register`` is done with it."""


def kill_at_first_version(url: str, home, server: str, killed: list, stop: threading.Event) -> None:
    """Poll the registry; SIGKILL ``server``'s process group the moment a ``teamcart`` version exists."""
    client = MlflowClient(url)
    while not stop.is_set():
        try:
            if client.search_model_versions("name = 'teamcart'"):
                pid = server_group(home, server)
                os.killpg(pid, signal.SIGKILL)
                killed.append((pid, time.monotonic()))
                return
        except Exception:  # the registered model does not exist yet
            pass
        time.sleep(0.05)


def run(tmp_path, who: str, mlflow_url: str, prefect_port: int) -> subprocess.CompletedProcess:
    env = clean_env(SIM2EDGE_HOME=str(tmp_path / who), MLFLOW_TRACKING_URI=mlflow_url,
                    PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api", OMP_NUM_THREADS="1",
                    PYTHONPATH=f"{REPO}:{tmp_path}")
    return subprocess.run([SIM2EDGE, "run", "--config", str(tmp_path / "tiny.yaml"), "--task", "team_task:TeamCart"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)


@pytest.mark.parametrize("server", ["mlflow", "prefect"])
def test_a_server_restart_mid_run_is_ridden_out_and_leaves_nothing_half_registered(server, postgres,  # noqa: F811
                                                                                    tmp_path):
    server_home, mlflow_port, prefect_port = tmp_path / "server", free_port(), free_port()
    log, mlflow_url = tmp_path / "up.log", f"http://127.0.0.1:{mlflow_port}"
    (tmp_path / "tiny.yaml").write_text(TINY)
    (tmp_path / "team_task.py").write_text(TASK)
    with log.open("wb") as out:
        up = subprocess.Popen([SIM2EDGE, "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                               "--database", f"postgresql://postgres@127.0.0.1:{postgres}/restart_{server}"],
                              env=clean_env(SIM2EDGE_HOME=str(server_home)), stdout=out, stderr=subprocess.STDOUT)
    killed: list = []
    stop = threading.Event()
    try:
        wait_up(up, log)
        killer = threading.Thread(target=kill_at_first_version, args=(mlflow_url, server_home, server, killed, stop))
        killer.start()
        first = run(tmp_path, "alice", mlflow_url, prefect_port)
        stop.set()
        killer.join()
        second = run(tmp_path, "bob", mlflow_url, prefect_port)
    finally:
        stop.set()
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert killed, "the registry never showed a version: " + first.stdout[-2000:]
    assert f"{server} exited with code -9; restarted" in log.read_text(), log.read_text()[-3000:]
    assert first.returncode == 0, first.stdout[-3000:]
    assert second.returncode == 0, second.stdout[-3000:]
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(server_home)

    db = f"restart_{server}_mlflow"
    versions = rows(postgres, db, "SELECT version, status FROM model_versions WHERE name = 'teamcart' ORDER BY version")
    assert len(versions) == 2 and all(s == "READY" for _, s in versions), versions  # one per run, no orphan
    for v, _ in versions:
        tags = dict(rows(postgres, db, f"SELECT key, value FROM model_version_tags "
                                       f"WHERE name = 'teamcart' AND version = {v}"))
        assert COMPLETE <= set(tags), (v, sorted(tags), first.stdout[-2000:])
    aliases = dict(rows(postgres, db, "SELECT alias, version FROM registered_model_aliases WHERE name = 'teamcart'"))
    assert aliases.get("champion") in {v for v, _ in versions}, aliases
