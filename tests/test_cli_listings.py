"""Listing commands (`targets`, `tasks`, `devices`): identifiers are never cut, in a pipe or a narrow
terminal, and `--json` gives the same records to scripts."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

from mlflow.tracking import MlflowClient

from edge.report import Reporter, tag_key
from edge.targets import PROFILES
from stages.sim.registry import names
from tests.conftest import run_cli

NARROW = {"COLUMNS": "40"}
"""Rich fits tables to $COLUMNS even when stdout is a pipe: 40 columns cut `orin-jp5.1` to `orin-jp5…` before."""


def lines_with(text: str, word: str) -> list[str]:
    """``grep -F word``."""
    return [line for line in text.splitlines() if word in line]


def test_targets_and_tasks_in_a_pipe_keep_every_identifier_whole():
    targets = run_cli("sim2edge", "targets", env=NARROW)
    assert targets.returncode == 0, targets.stderr
    for name in PROFILES:  # `sim2edge targets | grep orin-jp5.1` finds its row, with its TensorRT version
        (row,) = lines_with(targets.stdout, f" {name} ")
        assert PROFILES[name].tensorrt in row and PROFILES[name].module in row, targets.stdout
    assert "…" not in targets.stdout
    tasks = run_cli("sim2edge", "tasks", env=NARROW)
    assert tasks.returncode == 0 and "…" not in tasks.stdout, tasks.stderr
    for name in names():
        assert lines_with(tasks.stdout, f" {name} "), tasks.stdout


def test_targets_and_tasks_json():
    targets = json.loads(run_cli("sim2edge", "targets", "--json", env=NARROW).stdout)
    assert set(targets) == set(PROFILES) and targets["orin-jp5.1"]["tensorrt"] == PROFILES["orin-jp5.1"].tensorrt
    assert all(t["name"] == n for n, t in targets.items())
    tasks = json.loads(run_cli("sim2edge", "tasks", "--json", env=NARROW).stdout)
    assert list(tasks) == names()
    cartpole = tasks["cartpole"]
    assert len(cartpole["observations"]) == 5 and len(cartpole["actions"]) == 1
    assert cartpole["control_period_s"] > 0 and Path(cartpole["mjcf"]).is_file()


def in_terminal(args: list[str], columns: int, env: dict) -> str:
    """Run a console script with stdout on a pseudo-terminal ``columns`` wide; its output without colour codes."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([str(Path(sys.executable).parent / args[0]), *args[1:]], stdout=slave,
                            stderr=subprocess.PIPE, env={**os.environ, **env, "COLUMNS": str(columns)})
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())


def test_a_narrow_terminal_folds_the_other_columns_not_the_identifiers():
    out = in_terminal(["sim2edge", "targets"], 60, {})
    assert max(len(line) for line in out.splitlines()) <= 60, out
    for name in PROFILES:
        assert lines_with(out, f" {name} "), out
    assert "…" not in out


def test_devices_lists_reports_in_full_and_as_json(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    model = f"cartpole-orin-jp5.1-listing-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(model)
    device = "jetson-orin-nano-bench-07/left-arm"
    state = {"device": device, "hostname": "bench-07", "policy": model, "version": "3", "health": "ok",
             "runtime": "onnxruntime (CPUExecutionProvider)", "last_error": None, "pull_failures": 0,
             "time": round(time.time(), 3)}
    sent = Reporter(tmp_path, mlflow_server, model, tag_key(device), lambda: state).report()  # the agent's REST call
    assert sent is not None

    table = run_cli("sim2edge", "devices", "--model", model, env=NARROW)
    assert table.returncode == 0, table.stdout + table.stderr
    (row,) = lines_with(table.stdout, device)
    assert model in row and " 3 " in row and " ok " in row and "…" not in table.stdout, table.stdout

    listed = run_cli("sim2edge", "devices", "--model", model, "--json", env=NARROW)
    assert listed.returncode == 0, listed.stderr
    (d,) = json.loads(listed.stdout)
    assert (d["model"], d["device"], d["version"], d["health"]) == (model, device, "3", "ok")
    assert d["runtime"] == state["runtime"] and d["age_s"] >= 0
