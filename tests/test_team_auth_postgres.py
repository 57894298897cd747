"""A device agent pulls the champion through MLflow's artifact proxy with a device user that cannot write, on the
team stack on PostgreSQL with logins: `sim2edge up --auth --database postgresql://…` (Debian's PostgreSQL, started by
the test as its own process; the admin's password from ``SIM2EDGE_ADMIN_PASSWORD``), `sim2edge users add-device`
against it, and the device's user and grant read back from ``<db>_auth`` (tests/test_team_auth.py does the same on
SQLite)."""

from __future__ import annotations

import signal
import subprocess
import uuid

import pytest
from mlflow.tracking import MlflowClient

from tests.bundles import make_bundle, make_keys, publish
from tests.conftest import free_port, run_cli
from tests.servers import wait_up
from tests.test_team_auth import LOGIN_VARS, reads_its_policy_only
from tests.test_team_runs import SIM2EDGE, clean_env
from tests.test_up_postgres import pytestmark as needs_postgres
from tests.test_up_postgres import postgres, rows  # noqa: F401  (postgres: the fixture)
from tests.test_up_ports import none_left

pytestmark = [pytest.mark.slow, needs_postgres]


def test_a_device_user_pulls_the_champion_and_writes_nothing_on_postgresql(postgres, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    home, mlflow_port, prefect_port = tmp_path / "home", free_port(), free_port()
    password = "S2e-" + uuid.uuid4().hex
    env = {k: v for k, v in clean_env().items() if k not in LOGIN_VARS}
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([SIM2EDGE, "up", "--auth", "--mlflow-port", str(mlflow_port), "--prefect-port",
                               str(prefect_port), "--database", f"postgresql://postgres@127.0.0.1:{postgres}/fleet"],
                              env={**env, "SIM2EDGE_HOME": str(home), "SIM2EDGE_ADMIN_PASSWORD": password},
                              stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{mlflow_port}"
    try:
        priv, pub = make_keys(tmp_path)
        make_bundle(tmp_path / "arm-policy.tar", priv, name="arm-policy")  # while the servers boot
        wait_up(up, log, timeout_s=240)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
        assert publish(url, tmp_path / "arm-policy.tar", "arm-policy", "champion") == "1"
        MlflowClient(url).create_registered_model("other-policy")

        made = run_cli("sim2edge", "users", "add-device", "robot1", "--policy", "arm-policy",
                       env={"SIM2EDGE_HOME": str(home), "SIM2EDGE_ADMIN_PASSWORD": password},
                       unset=tuple(v for v in LOGIN_VARS if v != "SIM2EDGE_ADMIN_PASSWORD"))
        assert made.returncode == 0, made.stdout + made.stderr
        device = ("robot1", made.stdout.split("password (shown once): ")[1].strip())

        reads_its_policy_only(url, device)
        # (not asserted: MLflow's basic auth lets any login *create* a registered model or an experiment, which it
        # then manages; the device's login can do that too, but touches nothing it was not made owner of)

        # the real agent pulls the champion through the server's artifact proxy with the device's login
        pulled = run_cli("sim2edge-agent", "pull", "arm-policy@champion", "--registry", url, "--root",
                         str(tmp_path / "store"), "--trust", str(pub), "--skip-target-check",
                         env={"MLFLOW_TRACKING_USERNAME": device[0], "MLFLOW_TRACKING_PASSWORD": device[1]},
                         unset=("MLFLOW_TRACKING_URI",))
        assert pulled.returncode == 0 and "activated" in pulled.stdout, pulled.stdout + pulled.stderr
        # and a wrong password pulls nothing
        refused = run_cli("sim2edge-agent", "pull", "arm-policy@champion", "--registry", url, "--root",
                          str(tmp_path / "store2"), "--trust", str(pub), "--skip-target-check",
                          env={"MLFLOW_TRACKING_USERNAME": device[0], "MLFLOW_TRACKING_PASSWORD": device[1] + "x"},
                          unset=("MLFLOW_TRACKING_URI",))
        assert refused.returncode != 0 and "activated" not in refused.stdout
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(home)
    assert password not in log.read_text() + made.stdout
    assert not (home / "auth" / "admin-password").exists() and not (home / "mlflow" / "auth.db").exists()

    # read back after the servers stopped, straight from PostgreSQL
    users = dict(rows(postgres, "fleet_auth", "SELECT username, is_admin FROM users"))
    assert users == {"admin": True, "robot1": False}, users
    grants = rows(postgres, "fleet_auth", """
        SELECT m.name, m.permission FROM registered_model_permissions m JOIN users u ON m.user_id = u.id
        WHERE u.username = 'robot1'
        UNION ALL SELECT p.resource_pattern, p.permission FROM role_permissions p
        JOIN user_role_assignments a ON a.role_id = p.role_id JOIN users u ON a.user_id = u.id
        WHERE u.username = 'robot1' AND p.resource_type = 'registered_model'""")  # per-user grants or a role's
    assert grants == [("arm-policy", "READ")], (grants, rows(postgres, "fleet_auth", "SELECT * FROM role_permissions"))
    assert rows(postgres, "fleet_mlflow", "SELECT name FROM registered_models ORDER BY name") == [("arm-policy",),
                                                                                                  ("other-policy",)]
    tags = dict(rows(postgres, "fleet_mlflow", "SELECT key, value FROM registered_model_tags "
                                               "WHERE name = 'arm-policy'"))
    assert "hacked" not in tags
    assert rows(postgres, "fleet_mlflow", "SELECT alias, version FROM registered_model_aliases "
                                          "WHERE name = 'arm-policy'") == [("champion", 1)]
    assert not rows(postgres, "fleet_mlflow", "SELECT key FROM model_version_tags WHERE key = 'hacked'")
    assert (tmp_path / "store").exists()
