"""`sim2edge up --auth`: nobody reads MLflow without a login, a device user made by `sim2edge users add-device`
reads (and the real agent pulls) its own policy only and writes nothing; Prefect's API asks for the admin login;
`users add-device` refuses a missing server, a wrong admin password and an unknown policy in one line."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.bundles import make_bundle, make_keys, publish
from tests.conftest import free_port, run_cli
from tests.servers import wait_up
from tests.test_up_ports import none_left

LOGIN_VARS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PREFECT_API_URL",
              "SIM2EDGE_ADMIN_PASSWORD", "PREFECT_API_AUTH_STRING")


def status(url: str, login: tuple[str, str] | None = None, body: dict | None = None) -> int:
    """HTTP status of GET (or POST ``body``) ``url`` with basic auth ``login``."""
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if login:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(login).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def reads_its_policy_only(url: str, device: tuple[str, str]) -> None:
    """Anonymous reads of ``arm-policy`` refused, the device's allowed; another policy and every write refused."""
    api = f"{url}/api/2.0/mlflow"
    alias = f"{api}/registered-models/alias?name=arm-policy&alias=champion"
    assert status(alias) == 401  # no login, no read
    assert status(alias, device) == 200
    assert status(f"{api}/registered-models/get?name=other-policy", device) == 403
    writes = {"registered-models/set-tag": {"name": "arm-policy", "key": "hacked", "value": "1"},
              "registered-models/alias": {"name": "arm-policy", "alias": "champion", "version": "1"},
              "model-versions/set-tag": {"name": "arm-policy", "version": "1", "key": "hacked", "value": "1"},
              "registered-models/delete": {"name": "other-policy"}}
    for path, body in writes.items():
        assert status(f"{api}/{path}", device, body) == 403, path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`sim2edge up --auth` on SQLite (password generated), and meanwhile a signed bundle of ``arm-policy``; yields
    (home, mlflow URL, prefect URL, admin password, log, bundle, public key); SIGINT at the end, which must leave
    nothing running."""
    tmp = tmp_path_factory.mktemp("team-auth")
    home, mlflow_port, prefect_port = tmp / "home", free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in LOGIN_VARS}
    log = tmp / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "up", "--auth", "--mlflow-port",
                               str(mlflow_port), "--prefect-port", str(prefect_port)],
                              env={**env, "SIM2EDGE_HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        priv, pub = make_keys(tmp)
        make_bundle(tmp / "arm-policy.tar", priv, name="arm-policy")  # while the servers boot
        wait_up(up, log, timeout_s=180)
        password = (home / "auth" / "admin-password").read_text().strip()
        yield (home, f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}", password, log,
               tmp / "arm-policy.tar", pub)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(home)


def test_a_device_user_reads_its_policy_only_and_writes_nothing(stack, tmp_path, monkeypatch):
    home, url, prefect, password, log, tar, pub = stack
    assert f"logins      user admin, password in {home / 'auth' / 'admin-password'}" in log.read_text()
    for secret in (home / "auth" / "admin-password", home / "auth" / "auth.ini"):
        assert secret.stat().st_mode & 0o777 == 0o600, secret
    assert password not in log.read_text() + (home / "auth" / "auth.ini").read_text()

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    assert publish(url, tar, "arm-policy", "champion") == "1"
    MlflowClient(url).create_registered_model("other-policy")

    workspace = {"SIM2EDGE_HOME": str(home)}
    made = run_cli("sim2edge", "users", "add-device", "robot1", "--policy", "arm-policy", env=workspace,
                   unset=LOGIN_VARS)
    assert made.returncode == 0, made.stdout + made.stderr
    device = ("robot1", made.stdout.split("password (shown once): ")[1].strip())

    reads_its_policy_only(url, device)
    model = MlflowClient(url).get_registered_model("arm-policy")
    assert "hacked" not in model.tags and model.aliases == {"champion": "1"}

    # the real agent pulls with the device's login
    pulled = run_cli("sim2edge-agent", "pull", "arm-policy@champion", "--registry", url, "--root",
                     str(tmp_path / "store"), "--trust", str(pub), "--skip-target-check",
                     env={"MLFLOW_TRACKING_USERNAME": device[0], "MLFLOW_TRACKING_PASSWORD": device[1]})
    assert pulled.returncode == 0 and "activated" in pulled.stdout, pulled.stdout + pulled.stderr

    # Prefect's API: the admin login, nothing less (health stays open for probes)
    flows = f"{prefect}/api/flows/filter"
    assert status(flows, body={}) == 401 and status(flows, device, {}) == 401
    assert status(flows, ("admin", password), {}) == 200 and status(f"{prefect}/api/health") == 200


CLIENT = """
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from flows.workspace import Workspace

ws = Workspace.from_env()
ws.configure_prefect()
print(sorted(m.name for m in MlflowClient(ws.tracking_uri()).search_registered_models()))
with get_client(sync_client=True) as prefect:
    print(len(prefect.read_flows()))
"""


def test_clients_in_the_workspace_log_in_as_the_admin(stack):
    """What `sim2edge run` and `serve` do first: the workspace's servers, with the admin's login, on both."""
    home, *_ = stack
    done = subprocess.run([sys.executable, "-c", CLIENT], capture_output=True, text=True, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k not in LOGIN_VARS},
                               "SIM2EDGE_HOME": str(home)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "0" and "arm-policy" in done.stdout.splitlines()[-2]


def test_add_device_refuses_in_one_line(stack, tmp_path):
    home, _, _, password, *_ = stack
    cases = [({"SIM2EDGE_HOME": str(home), "SIM2EDGE_ADMIN_PASSWORD": password + "x"}, ["arm-policy"],
              "refused the admin login (HTTP 401)"),
             ({"SIM2EDGE_HOME": str(home)}, ["no-such-policy"], "--policy no-such-policy: no such registered model"),
             ({"SIM2EDGE_HOME": str(tmp_path)}, ["arm-policy"], "no MLflow server: start `sim2edge up --auth`")]
    runs = [subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "users", "add-device", "robot2",
                              *(f"--policy={p}" for p in policies)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**{k: v for k, v in os.environ.items() if k not in LOGIN_VARS}, **env})
            for env, policies, _ in cases]  # at once: each is mostly MLflow's import
    for run, (_, _, message) in zip(runs, cases):
        out = run.communicate(timeout=120)[0]
        lines = out.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and message in lines[0], lines
        assert password not in out
