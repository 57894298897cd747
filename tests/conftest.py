"""Shared fixtures: a real MLflow server on a free loopback port, Prefect's test harness, a workspace."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.workspace import Workspace
from stages.sim import registry

pytest_plugins = ["tests.agent_checks",  # the device agent's refusal fixtures: keys, registry, sibling, active
                  "tests.ci_skips"]  # under CI=true, a skip for a capability this machine can provide fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    """A fresh SIM2EDGE_HOME for the whole session."""
    home = tmp_path_factory.mktemp("sim2edge-home")
    os.environ["SIM2EDGE_HOME"] = str(home)
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(home / "prefect" / "storage")  # the stage cache, per session
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    return Workspace(home=home)


@pytest.fixture(scope="session")
def mlflow_server(workspace: Workspace):
    """A real MLflow tracking server (SQLite, artifact proxy) serving the workspace; yields its URL."""
    from flows import services

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workspace.home / "mlflow-server.log"
    server = services.start(workspace, "mlflow", services.mlflow_command(workspace, "127.0.0.1", port), url, "/health", log)
    try:
        services.wait_healthy([server])
    except RuntimeError:
        services.stop([server])
        pytest.fail(f"MLflow server did not start: {log.read_text()[-2000:]}")
    os.environ["MLFLOW_TRACKING_URI"] = url
    yield url
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    services.stop([server])


@pytest.fixture(scope="session")
def prefect_harness(workspace: Workspace):
    """Prefect's own test harness (a temporary API server with SQLite), session-scoped."""
    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def own_task():
    """``own_task(name, factory)``: a task registered through the public registry for this test only."""
    names = []

    def register(name: str, factory) -> None:
        registry.register(name, factory)
        names.append(name)

    yield register
    for name in names:
        registry.unregister(name)


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run a console script of this venv as a subprocess (``unset`` drops variables from its environment)."""
    exe = Path(sys.executable).parent / args[0]
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    return subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, env=full, cwd=cwd, timeout=600)
