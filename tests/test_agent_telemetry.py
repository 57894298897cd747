"""Telemetry recorded by ``sim2edge-agent run``, uploaded per registry/telemetry.py's contract, and ``watch``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from edge import telemetry
from edge.store import DeviceStore
from tests.bundles import make_bundle, make_keys, publish
from tests.conftest import run_cli
from tests.bundles import COMMAND_IO, active_store
from tests.test_agent_run import Client, start

AGENT = str(Path(sys.executable).parent / "sim2edge-agent")


def test_run_records_telemetry_and_upload_resumes_and_deletes_only_after_confirmation(mlflow_server, tmp_path):
    root = active_store(tmp_path, period_s=0.005, io=COMMAND_IO)  # inputs d and e are commands
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--telemetry", "--telemetry-rows", "10",
                          "--device-id", "dev-1", "--watchdog-periods", "100000")  # a loaded host's pause: no new episode
    client = Client(address, tmp_path)
    spread = np.array([0.01, -0.01, 0.0, 0.03, -0.03], np.float32)  # sums to 0: the action stays 0.5 * 5 * i / 100
    sent = np.arange(25, dtype=np.float32)[:, None] / 100 + spread
    for i in range(25):
        client.act(i, sent[i])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["telemetry_files"] == 3
    pending = sorted((root / "telemetry" / "pending").glob("*.npz"))
    cols = [telemetry.read(p) for p in pending]
    assert [len(c["step"]) for c in cols] == [10, 10, 5]
    steps = np.concatenate([c["step"] for c in cols])
    assert (steps == np.arange(25)).all() and (np.concatenate([c["episode"] for c in cols]) == 0).all()
    first = cols[0]
    assert int(first["schema_version"]) == telemetry.SCHEMA_VERSION == 2
    assert set(first) >= {"time", "obs.a", "obs.c", "cmd.d", "cmd.e", "act.u", "inference_ms", "loop_ms", "flags",
                          "policy_version", "device_id"}
    assert not {"obs.d", "obs.e"} & set(first), "the commands are recorded among the observations"
    recorded = {k: np.concatenate([c[k] for c in cols]) for k in ("obs.a", "obs.b", "obs.c", "cmd.d", "cmd.e")}
    assert np.stack(list(recorded.values()), axis=1) == pytest.approx(sent, abs=0)
    assert first["act.u"] == pytest.approx(np.clip(0.5 * 5 * np.arange(10) / 100, -0.5, 0.8), abs=1e-6)
    assert first["policy_version"][0] == "1" and first["device_id"][0] == "dev-1"
    assert (first["inference_ms"] > 0).all()

    task = f"agent-test-{uuid.uuid4().hex[:8]}"
    up = telemetry.Uploader(root, mlflow_server, task, "dev-1")
    assert up.upload(stop_after=1) == []  # interrupted after one file
    state = json.loads((root / "telemetry" / "upload.json").read_text())
    assert len(state["confirmed"]) == 1 and len(list((root / "telemetry" / "pending").glob("*.npz"))) == 3
    r = run_cli("sim2edge-agent", "upload", "--registry", mlflow_server, "--root", str(root), "--task", task,
                "--device-id", "dev-1")
    assert r.returncode == 0 and state["run_id"] in r.stdout, r.stderr
    assert not list((root / "telemetry" / "pending").glob("*.npz")) and not (root / "telemetry" / "upload.json").exists()
    # the run matches registry/telemetry.py's contract
    mc = MlflowClient(mlflow_server)
    exp = mc.get_experiment_by_name("sim2edge/telemetry")
    runs = mc.search_runs([exp.experiment_id], f"tags.`sim2edge.task` = '{task}'")
    assert [x.info.run_id for x in runs] == [state["run_id"]], "the resumed upload made a second run"
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert {k: run.data.tags[k] for k in ("sim2edge.telemetry", "sim2edge.device", "sim2edge.policy_version")} == \
        {"sim2edge.telemetry": "true", "sim2edge.device": "dev-1", "sim2edge.policy_version": "1"}
    listed = mc.list_artifacts(run.info.run_id, "telemetry")
    assert sorted(a.path.split("/")[-1] for a in listed) == [p.name for p in pending]
    local = mc.download_artifacts(run.info.run_id, f"telemetry/{pending[0].name}", str(tmp_path / "dl"))
    assert (telemetry.read(Path(local))["act.u"] == first["act.u"]).all()
    again = run_cli("sim2edge-agent", "upload", "--registry", mlflow_server, "--root", str(root), "--task", task)
    assert again.returncode == 0 and "nothing pending" in again.stdout


def test_recorder_stops_at_the_disk_cap_without_deleting(tmp_path):
    rec = telemetry.Recorder(tmp_path, ["a"], ["u"], "1", "dev", rows_per_file=4, cap_bytes=1)
    for i in range(12):
        rec.record(0, i, float(i), np.array([i], np.float32), np.array([0.0], np.float32), 1e-5, 0.01, 0)
    rec.flush()  # the files are written on the writer thread
    assert rec.files_written == 1 and rec.rows_dropped == 8
    assert len(list((tmp_path / "telemetry" / "pending").glob("*.npz"))) == 1


def test_watch_activates_a_new_champion(mlflow_server, tmp_path):
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    make_bundle(tmp_path / "1.tar", priv, version="1", name=name)
    publish(mlflow_server, tmp_path / "1.tar", name, "champion")
    root = tmp_path / "store"
    proc = subprocess.Popen([AGENT, "watch", f"{name}@champion", "--registry", mlflow_server, "--root", str(root),
                             "--trust", str(pub), "--skip-target-check", "--interval", "0.3", "--iterations", "100",
                             "--backoff", "1"],  # a poll that meets a busy server (SQLite locked) waits ~1 s, not 30
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    printed: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            printed.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        def active(deadline_s: float):
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                m = DeviceStore(root).current_manifest() if (root / "current").is_symlink() else None
                if m:
                    yield m["policy"]["version"]
                time.sleep(0.1)

        assert "1" in active(20)
        make_bundle(tmp_path / "2.tar", priv, version="2", name=name)
        publish(mlflow_server, tmp_path / "2.tar", name, "champion")
        assert "2" in active(20)
        # `current` switches first, then the journal, then the line: stop the agent only once it has printed
        end = time.monotonic() + 20
        while not any(f"activated {name} v2" in line for line in printed) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
        reader.join(timeout=10)
    out = "".join(printed)
    assert f"activated {name} v1" in out and f"activated {name} v2" in out
    events = DeviceStore(root).history()
    assert [(e["event"], e["version"]) for e in events if e["event"] != "unavailable"] == [("activate", "1"), ("activate", "2")]
