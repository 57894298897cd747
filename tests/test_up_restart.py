"""`sim2edge up` restarts a server that dies (here MLflow's, SIGKILLed with its workers): one line says so, what
was registered before is there after, and a client call made during the restart gets through on the MLflow
client's own retries; a server that cannot start again ends `up` with one line naming it and its log's end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows import services
from flows.services import Service, ServiceError
from tests.conftest import free_port
from tests.servers import wait_up
from tests.test_up_ports import marked, none_left


def start_up(home: Path, log: Path, mlflow_port: int, *options: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    with log.open("wb") as out:
        return subprocess.Popen([str(Path(sys.executable).parent / "sim2edge"), "up", "--mlflow-port",
                                 str(mlflow_port), "--prefect-port", str(free_port()), *options],
                                env={**env, "SIM2EDGE_HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)


def server_group(home: Path, server: str = "mlflow") -> int:
    """The pid (and process group) of the workspace's `python -m mlflow server` or `python -m prefect server`."""
    (pid,) = [pid for pid in marked(home) if leads_group(pid) and f"{server}\0server".encode() in cmdline(pid)]
    return pid


def leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:  # exited since it was listed
        return False


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def bound(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_killed_mlflow_server_is_restarted_with_its_data_and_a_client_rides_it_out(tmp_path):
    home, log, port = tmp_path / "home", tmp_path / "up.log", free_port()
    url = f"http://127.0.0.1:{port}"
    up = start_up(home, log, port)
    try:
        wait_up(up, log)
        client = MlflowClient(url)
        client.create_registered_model("before-restart")
        killed = server_group(home)
        os.killpg(killed, signal.SIGKILL)  # as the OOM killer of its cgroup would: the server and its worker
        wait_for(lambda: not answers(url), 5, "the killed server still answers")
        started = time.monotonic()
        names = [m.name for m in client.search_registered_models()]  # retried until the new server answers
        assert names == ["before-restart"] and time.monotonic() - started < 120
        line = "mlflow exited with code -9; restarted (1 of 5 in the last 10 min)"
        assert line in log.read_text().splitlines(), log.read_text()[-3000:]
        assert f"sim2edge up: {line}" in (home / "logs" / "mlflow.log").read_text()
        assert answers(url) and server_group(home) != killed and up.poll() is None
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0, log.read_text()[-3000:]
    assert none_left(home)


def test_a_server_that_cannot_start_again_ends_up_with_one_line(tmp_path):
    home, log, port = tmp_path / "home", tmp_path / "up.log", free_port()
    up = start_up(home, log, port, "--max-restarts", "1")
    try:
        wait_up(up, log)
        os.killpg(server_group(home), signal.SIGKILL)
        with socket.socket() as squatter:  # its port taken before it starts again: the restart fails too
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            wait_for(lambda: bound(squatter, port), 10, "port not freed")
            squatter.listen()
            up.wait(timeout=180)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)
    lines = log.read_text().splitlines()
    mlflow_log = home / "logs" / "mlflow.log"
    assert up.returncode == 1, lines
    assert "mlflow exited with code -9; restarted (1 of 1 in the last 10 min)" in lines
    (error,) = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert lines[error].startswith("error: mlflow exited with code ")
    assert lines[error].endswith(f"after 1 restart in the last 10 min; giving up; the end of its log {mlflow_log}:")
    assert "address already in use" in "\n".join(lines[error + 1:]).lower()
    assert "Traceback" not in "\n".join(lines[:error]) and none_left(home)


class Enough(Exception):
    """Raised by a test's ``report`` to end :func:`services.supervise`, which never returns."""


def short_lived(tmp_path: Path, seconds: float) -> Service:
    """A 'server' that exits with code 3 after ``seconds``."""
    cmd = [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit(3)"]
    log = tmp_path / "short.log"
    return Service("short", "http://127.0.0.1:9", "/", services.spawn(cmd, dict(os.environ), log), log, cmd,
                   dict(os.environ))


def test_restarts_beyond_the_budget_give_up_naming_the_server_and_its_log(tmp_path):
    s, lines = short_lived(tmp_path, 0), []
    with pytest.raises(ServiceError) as raised:
        services.supervise([s], lines.append, max_restarts=2, poll_s=0.1)
    assert lines == [f"short exited with code 3; restarted ({n} of 2 in the last 10 min)" for n in (1, 2)]
    assert str(raised.value).startswith("short exited with code 3 after 2 restarts in the last 10 min; giving up; "
                                        f"the end of its log {s.log}:")
    assert s.log.read_text().splitlines() == [f"sim2edge up: {line}" for line in lines]


def test_restarts_older_than_the_window_do_not_count(tmp_path):
    s, lines = short_lived(tmp_path, 0.5), []

    def report(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:
            raise Enough

    try:
        with pytest.raises(Enough):
            services.supervise([s], report, max_restarts=1, window_s=0.3, poll_s=0.1)
    finally:
        services.stop([s])
    assert lines == ["short exited with code 3; restarted (1 of 1 in the last 0.005 min)"] * 3
