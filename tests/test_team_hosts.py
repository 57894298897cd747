"""`sim2edge up --host 0.0.0.0` is reachable by the team under the machine's name: MLflow's DNS-rebinding
protection (a 403 for any Host header it does not know) is told this machine's hostname and addresses and the names
of ``--allowed-host``, and still refuses others; its UI's origin may change things, another origin may not; Prefect's
UI calls its API by the machine's name, not 0.0.0.0. Real servers, started by the CLI."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from flows.services import interface_addresses
from tests.conftest import free_port, run_cli
from tests.servers import wait_up
from tests.test_up_ports import none_left

PROXY = "robots.lab.example"


def status(url: str, host: str | None = None, origin: str | None = None, body: dict | None = None) -> int:
    """The HTTP status of GET ``url`` (POST of ``body``), with the given Host and Origin headers."""
    headers = {k: v for k, v in {"Host": host, "Origin": origin}.items() if v}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {**headers, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_up_on_all_interfaces_answers_the_machines_names_and_refuses_others(tmp_path):
    home, mlflow_port, prefect_port = tmp_path / "home", free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "up", "--host", "0.0.0.0",
                               "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                               "--allowed-host", PROXY], env={**env, "SIM2EDGE_HOME": str(home)},
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_up(up, log)
        assert "0.0.0.0" not in log.read_text()  # the URLs printed are ones a teammate can open
        search = f"http://127.0.0.1:{mlflow_port}/api/2.0/mlflow/experiments/search?max_results=1"
        name = socket.gethostname()
        assert status(search) == 200
        assert status(search, host=f"{name}:{mlflow_port}") == 200
        assert status(search, host=PROXY) == 200 and status(search, host=f"{PROXY}:443") == 200
        assert status(search, host=f"attacker.example:{mlflow_port}") == 403  # the protection still holds
        assert status(search, host=f"{PROXY}.attacker.example") == 403
        for address in sorted(a for a in interface_addresses() if a.count(".") == 3
                              and not ipaddress.ip_address(a).is_loopback):  # by address: its own Host header
            assert status(f"http://{address}:{mlflow_port}/api/2.0/mlflow/experiments/search?max_results=1") == 200

        create = f"http://127.0.0.1:{mlflow_port}/api/2.0/mlflow/experiments/create"
        ui = f"http://{name}:{mlflow_port}"  # the UI's page, opened by the machine's name, creates an experiment
        assert status(create, host=f"{name}:{mlflow_port}", origin=ui, body={"name": "from-the-ui"}) == 200
        assert status(create, host=PROXY, origin=f"https://{PROXY}", body={"name": "through-the-proxy"}) == 200
        assert status(create, host=f"{name}:{mlflow_port}", origin="http://attacker.example",
                      body={"name": "cross-site"}) == 403

        with urllib.request.urlopen(f"http://127.0.0.1:{prefect_port}/ui-settings", timeout=30) as r:
            api_url = json.load(r)["api_url"]
        assert api_url.endswith(f":{prefect_port}/api") and "0.0.0.0" not in api_url
        assert status(f"{api_url}/health") == 200  # the URL the browser is given answers
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(home)


@pytest.mark.parametrize("name", ["*", "http://robots.lab.example", "robots lab", ""])
def test_a_bad_allowed_host_is_refused_in_one_line(tmp_path, name):
    done = run_cli("sim2edge", "up", "--host", "0.0.0.0", "--mlflow-port", str(free_port()), "--prefect-port",
                   str(free_port()), "--allowed-host", name, env={"SIM2EDGE_HOME": str(tmp_path)},
                   unset=("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and lines == [f"error: --allowed-host {name!r}: expected a host name or address, "
                                              "optionally with :PORT (e.g. robots.lab.example or "
                                              "mlflow.lab.example:443)"], lines
    assert none_left(tmp_path) and not (tmp_path / "logs").exists()
