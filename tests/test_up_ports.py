"""`sim2edge up` refuses a taken port in one line before it starts anything, and names a server that dies
during start-up with its exit code and log; no traceback either way."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.services import port_free
from tests.conftest import free_port, run_cli


def marked(home: Path) -> list[int]:
    """Pids of processes started for workspace ``home`` (their environment holds its SIM2EDGE_HOME)."""
    mark = f"SIM2EDGE_HOME={home}".encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def none_left(home: Path, timeout_s: float = 10) -> bool:
    """Whether every process of the workspace is gone within ``timeout_s`` (SIGTERM'd workers exit shortly after)."""
    deadline = time.monotonic() + timeout_s
    while marked(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not marked(home)


def up(home: Path, mlflow_port: int, prefect_port: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    done = run_cli("sim2edge", "up", "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect_port),
                   env={"SIM2EDGE_HOME": str(home), **env}, unset=("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))
    return done, (done.stdout + done.stderr).strip().splitlines()


@pytest.fixture
def taken_port():
    """A port with `python -m http.server` listening on it; yields (port, the server's pid)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while port_free("127.0.0.1", port):
        assert server.poll() is None and time.monotonic() < deadline, "http.server did not listen"
        time.sleep(0.1)
    yield port, server.pid
    server.terminate()
    server.wait()


@pytest.mark.parametrize("option", ["--mlflow-port", "--prefect-port"])
def test_a_taken_port_is_refused_in_one_line_and_nothing_starts(taken_port, option, tmp_path):
    port, pid = taken_port
    other = free_port()
    ports = (port, other) if option == "--mlflow-port" else (other, port)
    done, lines = up(tmp_path, *ports)
    assert done.returncode == 2, lines
    (line,) = lines
    assert line.startswith(f"error: port {port} on 127.0.0.1 is in use (pid {pid} ") and "http.server" in line
    assert line.endswith(f"; pass {option}")
    assert port_free("127.0.0.1", other) and none_left(tmp_path)
    assert not (tmp_path / "logs").exists()  # no server was started, not even briefly


def test_the_same_port_twice_is_refused(tmp_path):
    port = free_port()
    done, lines = up(tmp_path, port, port)
    assert done.returncode == 2 and lines == [f"error: --mlflow-port and --prefect-port are the same port ({port}); "
                                              "give each its own"]


def test_a_server_that_dies_at_start_up_is_named_with_its_code_and_log(tmp_path):
    # a setting Prefect refuses: its server exits within seconds, while MLflow's is starting
    mlflow_port, prefect_port = free_port(), free_port()
    done, lines = up(tmp_path, mlflow_port, prefect_port, PREFECT_LOGGING_LEVEL="bogus")
    log = tmp_path / "logs" / "prefect.log"
    assert done.returncode == 1, lines
    assert lines[0].startswith("error: prefect exited with code ") and lines[0].endswith(f"the end of its log {log}:")
    code = lines[0].removeprefix("error: prefect exited with code ").split()[0]
    assert code.isdigit() and code != "0"
    tail = lines[1:]  # the log's last lines, as they are: no traceback of sim2edge's own
    assert tail and tail == log.read_text().strip().splitlines()[-len(tail):] and len(tail) <= 8
    assert "LoggingSettings" in done.stdout  # Prefect's own reason is among them
    assert none_left(tmp_path) and port_free("127.0.0.1", mlflow_port) and port_free("127.0.0.1", prefect_port)
