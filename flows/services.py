"""``sim2edge up``: a Prefect server and an MLflow tracking server on loopback, for one workspace; and the
check that a Prefect server answers, which ``sim2edge serve`` needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flows.workspace import Workspace, healthy


@dataclass
class Service:
    name: str
    url: str
    health: str
    process: subprocess.Popen


def mlflow_command(ws: Workspace, host: str, port: int) -> list[str]:
    ws.mlflow_artifacts.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{ws.mlflow_db}",
            "--artifacts-destination", str(ws.mlflow_artifacts), "--serve-artifacts",
            "--host", host, "--port", str(port), "--workers", "1"]


def prefect_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)]


def start(ws: Workspace, name: str, cmd: list[str], url: str, health: str, log: Path) -> Service:
    # the UI's browser code calls the API at PREFECT_UI_API_URL (default: port 4200)
    env = dict(os.environ, PREFECT_HOME=str(ws.prefect_home), PREFECT_UI_API_URL=f"{url}/api")
    env.pop("PREFECT_API_URL", None)
    out = open(log, "ab")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Service(name, url, health, proc)


def wait_healthy(services: list[Service], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending and time.monotonic() < deadline:
        for s in list(pending):
            if s.process.poll() is not None:
                raise RuntimeError(f"{s.name} exited with code {s.process.returncode} (see its log)")
            if healthy(s.url, s.health):
                pending.remove(s)
        time.sleep(0.5)
    if pending:
        raise RuntimeError(f"{', '.join(s.name for s in pending)} not healthy after {timeout_s:.0f} s")


def stop(services: list[Service], grace_s: float = 8.0) -> None:
    """SIGTERM each process group, then SIGKILL what is still alive after the grace period."""
    for s in services:
        if s.process.poll() is None:
            os.killpg(s.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for s in services:
        try:
            s.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(s.process.pid, signal.SIGKILL)
            s.process.wait()


def up(ws: Workspace, host: str, prefect_port: int, mlflow_port: int) -> list[Service]:
    """Start both servers, wait until healthy, and record their URLs in the workspace."""
    logs = ws.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ws.prefect_home.mkdir(parents=True, exist_ok=True)
    mlflow_url, prefect_url = f"http://{host}:{mlflow_port}", f"http://{host}:{prefect_port}"
    services = [
        start(ws, "mlflow", mlflow_command(ws, host, mlflow_port), mlflow_url, "/health", logs / "mlflow.log"),
        start(ws, "prefect", prefect_command(host, prefect_port), prefect_url, "/api/health", logs / "prefect.log"),
    ]
    try:
        wait_healthy(services)
    except BaseException:
        stop(services)
        raise
    ws.services_file.write_text(json.dumps({"mlflow": mlflow_url, "prefect": prefect_url}))
    return services


class PrefectUnavailable(RuntimeError):
    """No Prefect server answers; the message says which and what to do."""


def prefect_api() -> str:
    """The configured Prefect API URL (``PREFECT_API_URL``, set by :meth:`Workspace.configure_prefect` while
    ``sim2edge up`` runs), if a server answers there. ``sim2edge serve`` needs one that outlives it: Prefect's
    temporary server would stop with the serving process, and with the same Ctrl-C, before the schedules
    are paused on it."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        raise PrefectUnavailable("no Prefect server to serve on: start `sim2edge up` in this workspace "
                                 "or set PREFECT_API_URL")
    if not healthy(api, "/health"):
        raise PrefectUnavailable(f"the Prefect server at {api} does not answer: start `sim2edge up` "
                                 "or check PREFECT_API_URL")
    return api
