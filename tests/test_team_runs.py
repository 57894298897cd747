"""Two people's `sim2edge run` at once against one team stack: `sim2edge up --database postgresql://…` on a real
PostgreSQL (Debian's, started by the test as its own process), and two pipeline runs of the same policy from two
workspaces (two laptops: their own datasets, keys and stage caches) pointed at the shared servers through
``MLFLOW_TRACKING_URI`` and ``PREFECT_API_URL``. Both runs go through every stage (collect → … → register) with the
smallest budgets a run configuration allows and a gate every policy passes (the cart-pole under another name,
whose every episode counts as a success: the scenario suite's own floors need more training than a test can give), so
both try to promote against the same (absent) champion: the promote slot (a Prefect global concurrency limit, now in PostgreSQL) lets one win, and the
registry, read back through MLflow and straight from PostgreSQL, holds both versions with their lineage and no
half-registered one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from registry import models
from tests.conftest import free_port
from tests.servers import wait_up
from tests.test_up_postgres import pytestmark as needs_postgres
from tests.test_up_postgres import postgres, rows  # noqa: F401  (postgres: the fixture)
from tests.test_up_ports import none_left

pytestmark = [pytest.mark.slow, needs_postgres]

SIM2EDGE = str(Path(sys.executable).parent / "sim2edge")
TINY = """\
iterations: 2
num_envs: 16
train:
  steps_per_env: 8
  hidden_dims: [16]
calibrate:
  max_windows: 8
  generations: 2
  search_generations: 1
  max_latency: 0
  joint_steps: 0
  bootstrap: 20
eval_episodes: 8
collect_episodes: 2
gate:
  min_success_rate: 0.0
  max_joint_limit_fraction: 1.0
  max_saturation_fraction: 1.0
  max_latency_fraction: 100.0
"""

TASK = '''\
from dataclasses import dataclass

import numpy as np

from stages.sim.cartpole import CartPole


@dataclass(frozen=True)
class TeamCart(CartPole):
    name: str = "teamcart"
    success_threshold: float = -1e9

    def terminated(self, qpos, qvel):
        return np.zeros(len(qpos), dtype=bool)
'''
REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "SIM2EDGE_HOME",
            models.BARRIER_ENV)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def test_two_runs_at_once_on_the_postgresql_team_stack(postgres, tmp_path):  # noqa: F811
    server_home, mlflow_port, prefect_port = tmp_path / "server", free_port(), free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([SIM2EDGE, "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                               "--database", f"postgresql://postgres@127.0.0.1:{postgres}/race"],
                              env=clean_env(SIM2EDGE_HOME=str(server_home)), stdout=out, stderr=subprocess.STDOUT)
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    (tmp_path / "team_task.py").write_text(TASK)
    try:
        wait_up(up, log)
        runs = {}
        for who in ("alice", "bob"):
            home = tmp_path / who
            env = clean_env(SIM2EDGE_HOME=str(home), MLFLOW_TRACKING_URI=mlflow_url,
                            PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api", OMP_NUM_THREADS="1",
                            PYTHONPATH=f"{REPO}:{tmp_path}")
            runs[who] = subprocess.Popen([SIM2EDGE, "run", "--config", str(config), "--task", "team_task:TeamCart"],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outs = {who: p.communicate(timeout=900)[0] for who, p in runs.items()}
        if all(p.returncode == 0 for p in runs.values()):  # the champion's bundle, through MLflow's artifact proxy
            champion_version, bundle = models.registered_bundle(MlflowClient(mlflow_url), "teamcart", "champion",
                                                                tmp_path / "download")
    finally:
        for p in locals().get("runs", {}).values():
            if p.poll() is None:
                p.kill()
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    for who, out in outs.items():
        (tmp_path / f"{who}.log").write_text(out)
    assert {who: p.returncode for who, p in runs.items()} == {"alice": 0, "bob": 0}, \
        {who: [line[:400] for line in out.splitlines() if "rror" in line][-6:] for who, out in outs.items()}
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(server_home)

    # read back after the servers stopped, straight from PostgreSQL
    versions = rows(postgres, "race_mlflow", "SELECT version, status, run_id FROM model_versions "
                                             "WHERE name = 'teamcart' ORDER BY version")
    assert [(v, s) for v, s, _ in versions] == [(1, "READY"), (2, "READY")], versions  # none half-registered
    aliases = dict(rows(postgres, "race_mlflow", "SELECT alias, version FROM registered_model_aliases "
                                                 "WHERE name = 'teamcart'"))
    assert sorted(aliases) == ["challenger", "champion"] and {aliases["champion"], aliases["challenger"]} == {1, 2}
    tags = {}
    for v, _, _ in versions:
        tags[v] = dict(rows(postgres, "race_mlflow", f"SELECT key, value FROM model_version_tags "
                                                     f"WHERE name = 'teamcart' AND version = {v}"))
    champion, loser = aliases["champion"], aliases["challenger"]
    assert all(t["sim2edge.gate"] == "pass" for t in tags.values())  # both could have promoted
    assert "sim2edge.not_promoted" not in tags[champion]
    assert tags[loser]["sim2edge.not_promoted"] == f"the champion changed during this run (vNone → v{champion})"

    # lineage: each version's package run is a child of its own pipeline run, which finished, and the two differ
    by_run = {}
    for v, _, run_id in versions:
        t = tags[v]
        assert {models.TAG_PATH, models.TAG_SHA256, "sim2edge.dataset_digest", "sim2edge.twin_digest",
                "sim2edge.pipeline_run_id"} <= set(t), t
        (parent,) = rows(postgres, "race_mlflow", f"SELECT value FROM tags WHERE run_uuid = '{run_id}' "
                                                  f"AND key = 'mlflow.parentRunId'")
        assert parent[0] == t["sim2edge.pipeline_run_id"]
        (status,) = rows(postgres, "race_mlflow", f"SELECT status FROM runs WHERE run_uuid = '{parent[0]}'")
        assert status == ("FINISHED",)
        by_run[parent[0]] = v
    assert len(by_run) == 2

    # Prefect: both flow runs completed on the server's PostgreSQL; the promote slot exists and is free
    flows = rows(postgres, "race_prefect", "SELECT fr.state_type FROM flow_run fr JOIN flow f ON fr.flow_id = f.id "
                                           "WHERE f.name = 'sim-to-edge'")
    assert sorted(s for (s,) in flows) == ["COMPLETED", "COMPLETED"], flows
    assert rows(postgres, "race_prefect", "SELECT \"limit\", active_slots FROM concurrency_limit_v2 "
                                          "WHERE name = 'promote-teamcart'") == [(1, 0)]

    # through MLflow's proxy, before the servers stopped: the champion's bundle matched its tagged digest
    assert int(champion_version) == champion and bundle.stat().st_size == int(tags[champion][models.TAG_SIZE])
    assert not list((tmp_path / "alice").glob("mlflow/*.db")) + list((tmp_path / "bob").glob("mlflow/*.db"))
