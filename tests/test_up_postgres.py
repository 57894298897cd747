"""`sim2edge up --database postgresql://…` runs MLflow and Prefect on a real PostgreSQL (Debian's, started by the
test as its own process): what a client registers lands in PostgreSQL, Prefect's tables are there, and with
``--auth`` MLflow's users are in a third database; an unreachable server or a bad URL is refused in one line
before anything starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port, run_cli
from tests.servers import wait_up
from tests.test_up_ports import none_left

PG_BIN = Path("/usr/lib/postgresql/15/bin")
pytestmark = pytest.mark.skipif(not (PG_BIN / "initdb").exists() or os.geteuid() != 0,
                                reason="needs Debian's postgresql (15) and root to run it as the postgres user")


def as_postgres(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of the test's own on a loopback port (trust auth, socket in its folder); yields its port."""
    root = Path(tempfile.mkdtemp(prefix="s2e-postgres-"))  # pytest's own folder is closed to other users
    shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    done = as_postgres(str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    assert done.returncode == 0, done.stderr
    done = as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-w", "-o",
                       f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
    assert done.returncode == 0, done.stderr + (root / "server.log").read_text()
    yield port
    as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
    shutil.rmtree(root, ignore_errors=True)


def rows(port: int, database: str, query: str) -> list[tuple]:
    import psycopg2

    with psycopg2.connect(host="127.0.0.1", port=port, user="postgres", dbname=database) as conn:
        with conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall()


def test_up_on_postgresql_keeps_mlflow_and_prefect_there(postgres, tmp_path, monkeypatch):
    """With ``--auth`` too: MLflow's users in a third database, the admin's password from the environment."""
    home, mlflow_port, prefect_port = tmp_path / "home", free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    password = "S2e-" + uuid.uuid4().hex
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "up", "--mlflow-port", str(mlflow_port),
                               "--prefect-port", str(prefect_port), "--auth", "--database",
                               f"postgresql://postgres@127.0.0.1:{postgres}/team"],
                              env={**env, "SIM2EDGE_HOME": str(home), "SIM2EDGE_ADMIN_PASSWORD": password},
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_up(up, log)
        assert f"database    postgresql://postgres@127.0.0.1:{postgres}/team" in log.read_text()
        client = MlflowClient(f"http://127.0.0.1:{mlflow_port}")
        client.create_registered_model("team-policy", tags={"sim2edge.test": "postgres"})
        with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/api/health", timeout=10) as r:
            assert r.status == 200
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(home)
    assert rows(postgres, "team_mlflow", "SELECT name FROM registered_models") == [("team-policy",)]
    tables = {t for (t,) in rows(postgres, "team_prefect", "SELECT tablename FROM pg_tables WHERE schemaname='public'")}
    assert {"flow", "flow_run", "deployment", "alembic_version"} <= tables  # Prefect's migrations ran there
    assert not (home / "mlflow.db").exists()
    assert rows(postgres, "team_auth", "SELECT username, is_admin FROM users") == [("admin", True)]
    assert not (home / "mlflow" / "auth.db").exists() and not (home / "auth" / "admin-password").exists()
    assert password not in log.read_text()


def test_unreachable_or_malformed_databases_are_refused_in_one_line(tmp_path):
    home = tmp_path / "home"
    cases = {f"postgresql://postgres@127.0.0.1:{free_port()}/team": (1, "cannot connect"),
             "mysql://root@127.0.0.1/team": (2, "expected postgresql://USER[:PASSWORD]@HOST[:PORT]/NAME"),
             "postgresql://postgres@127.0.0.1/te-am": (2, "base name 'te-am' must be letters, digits and _")}
    for url, (code, message) in cases.items():
        done = run_cli("sim2edge", "up", "--mlflow-port", str(free_port()), "--prefect-port", str(free_port()),
                       "--database", url, env={"SIM2EDGE_HOME": str(home)}, unset=("PREFECT_API_URL",))
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert done.returncode == code and len(lines) == 1 and message in lines[0], (url, lines)
        assert "Traceback" not in done.stderr and none_left(home)
