"""``watch`` reports the device's state to the registry (edge/report.py); registry/devices.py and
``sim2edge devices`` read it back. Against the real MLflow server on loopback, and against a registry
that is down or never answers (the watch must go on, and report later)."""

from __future__ import annotations

import json
import signal
import socket
import time
import uuid

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from edge import crash, signing
from edge.pull import PullOptions, watch
from edge.registry_client import TransferOptions
from edge.report import device_reporter, device_state, tag_key
from edge.store import DeviceStore
from registry.devices import devices
from tests.bundles import TINY_IO, active_store, make_keys, publish_versions
from tests.conftest import free_port, run_cli
from tests.test_agent_run import Client, start

FAST = PullOptions(TransferOptions(attempts=2, backoff_base_s=0.01, timeout_s=2), backoff_base_s=0.2)


@pytest.fixture()
def policy(mlflow_server, tmp_path):
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp_path, priv, name, 2, alias="champion")
    return name, signing.load_trusted([pub]), pub


def test_watch_reports_state_and_devices_lists_it(mlflow_server, policy, tmp_path):
    name, _, pub = policy
    r = run_cli("sim2edge-agent", "watch", f"{name}@champion", "--registry", mlflow_server, "--root",
                str(tmp_path / "a"), "--trust", str(pub), "--skip-target-check", "--interval", "0.05",
                "--iterations", "2", "--device-id", "jetson 7/a", "--label", "site=lab-1")
    assert r.returncode == 0 and f"activated {name} v2" in r.stdout, r.stderr
    tags = MlflowClient(mlflow_server).get_registered_model(name).tags
    assert set(k for k in tags if k.startswith("sim2edge.device.")) == {"sim2edge.device.jetson_7_a"}
    (d,) = devices(MlflowClient(mlflow_server), name)
    assert (d.device, d.policy, d.version, d.health, d.runtime) == \
        ("jetson 7/a", name, "2", "ok", "onnxruntime (CPUExecutionProvider)")
    assert d.hostname == socket.gethostname() and 0 <= d.age_s < 60 and d.missed_reports == 0
    assert d.last_error is None and d.pull_failures == 0 and d.labels == {"site": "lab-1"}
    out = run_cli("sim2edge", "devices", "--model", name, env={"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "jetson 7/a" in line)
    assert name in row and " 2 " in row and " ok " in row, out.stdout
    bad = run_cli("sim2edge", "devices", "--model", f"nope-{uuid.uuid4().hex[:6]}")
    assert bad.returncode == 2 and "nope-" in bad.stdout


def test_registry_down_never_stops_the_watch_and_the_next_report_says_what_was_missed(mlflow_server, policy,
                                                                                      tmp_path, capfd):
    name, trusted, _ = policy
    root = tmp_path / "store"
    watch(f"{name}@1", mlflow_server, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=1, device_id="dev-down")
    down = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    watch(f"{name}@champion", down, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=3, device_id="dev-down")  # returns: neither the pull nor the report raises
    assert time.monotonic() - start < 5
    assert "state report failed" in capfd.readouterr().err
    mark = json.loads((root / "report.json").read_text())
    assert mark["failures"] == 1 and mark["missed"] == 3, mark  # one attempt, then two skipped in its backoff
    assert DeviceStore(root).current_manifest()["policy"]["version"] == "1"
    time.sleep(0.25)  # past both backoffs (base 0.2 s)
    watch(f"{name}@champion", mlflow_server, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=1, device_id="dev-down")
    (d,) = devices(MlflowClient(mlflow_server), name)
    assert d.version == "2" and d.health == "ok" and d.missed_reports == 3
    assert d.last_error["event"] == "unavailable" and "unreachable" in d.last_error["detail"]
    assert json.loads((root / "report.json").read_text())["missed"] == 0


def test_a_registry_that_never_answers_costs_one_short_timeout(tmp_path):
    root = active_store(tmp_path)
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        reporter = device_reporter(root, "http://127.0.0.1:%d" % silent.getsockname()[1], "tiny", "dev", [],
                                   timeout_s=0.3)
        start = time.monotonic()
        assert reporter.report() is None
        assert time.monotonic() - start < 1.5
        start = time.monotonic()
        assert reporter.report() is None and time.monotonic() - start < 0.1  # backing off: not even tried
    assert json.loads((root / "report.json").read_text())["failures"] == 1


def test_state_says_rolled_back_and_corrupt(mlflow_server, policy, tmp_path, monkeypatch):
    name, trusted, _ = policy
    root = tmp_path / "store"
    watch(f"{name}@1", mlflow_server, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=1)
    assert not (root / "report.json").exists(), "reported without a device id"
    monkeypatch.setenv(crash.CORRUPT_ENV, "switched:policy.onnx")
    watch(f"{name}@2", mlflow_server, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=1, device_id="dev-rb")
    (d,) = devices(MlflowClient(mlflow_server), name)
    assert (d.version, d.health, d.last_error["event"], d.last_error["version"]) == ("1", "rolled-back",
                                                                                    "health-rollback", "2")
    store = DeviceStore(root)
    onnx = store.link("current") / "policy.onnx"
    onnx.chmod(0o600)
    onnx.write_bytes(onnx.read_bytes()[:-1] + b"\0")
    state = device_state(store, trusted, "dev-rb")
    assert state["health"] == "corrupt" and "policy.onnx" in state["last_error"]["detail"]
    assert tag_key("dev-rb") == "sim2edge.device.dev-rb"


def test_run_reports_its_control_loop_and_devices_merges_it_with_watch(mlflow_server, tmp_path):
    """``run --registry`` posts ControlLoop.stats() periodically and at exit under its own tag; the percentiles
    cover only the last --stats-window periods; ``devices`` shows one row with both reports."""
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp_path, priv, name, 1, io=TINY_IO, period_s=0.01)
    root = tmp_path / "store"
    watch(f"{name}@champion", mlflow_server, root, signing.load_trusted([pub]), interval_s=0, skip_target_check=True,
          options=FAST, iterations=1, device_id="arm-3")
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--registry", mlflow_server, "--report-every", "0.2",
                          "--device-id", "arm-3", "--stats-window", "8", "--watchdog-periods", "100000",
                          serving=f"{name} v1")
    try:
        client = Client(address, tmp_path)
        for seq in range(1, 21):
            assert client.act(seq, np.full(5, 0.1))[0] == seq
        tags = MlflowClient(mlflow_server).get_registered_model(name).tags
        deadline = time.monotonic() + 10
        while "sim2edge.control.arm-3" not in tags and time.monotonic() < deadline:  # the periodic report
            time.sleep(0.1)
            tags = MlflowClient(mlflow_server).get_registered_model(name).tags
        assert "sim2edge.control.arm-3" in tags
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    final = json.loads(out.strip().splitlines()[-1])
    assert final["observations"] == 20 and final["window"] == 8
    (d,) = devices(MlflowClient(mlflow_server), name)
    assert (d.device, d.version, d.health) == ("arm-3", "1", "ok")  # from watch
    c = d.control  # from run: the report sent at exit carries the final counts
    assert c["observations"] == 20 and c["window"] == 8 and c["act_p99_us"] > 0 and c["device"] == "arm-3"
    assert c["ticks"] >= 20 and c["missed_reports"] == 0
    row = run_cli("sim2edge", "devices", "--model", name, env={"COLUMNS": "250"}).stdout
    assert "arm-3" in row and " ok " in row and "act p99" in row and "ticks" in row, row


def test_run_with_the_registry_down_keeps_its_rate(tmp_path):
    """Reports to a dead registry fail on their own thread; the loop answers and keeps the period."""
    root = active_store(tmp_path, period_s=0.01)
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--registry", f"http://127.0.0.1:{free_port()}",
                          "--report-every", "0.05", "--duration", "1.0")
    client = Client(address, tmp_path)
    assert all(client.act(seq, np.zeros(5))[0] == seq for seq in range(1, 11))
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0 and "run: state report failed" in err, err
    stats = json.loads(out.strip().splitlines()[-1])
    mark = json.loads((root / "control-report.json").read_text())
    assert mark["failures"] >= 1 and mark["missed"] >= 1, mark
    periods, expected = stats["ticks"] + stats["skipped_periods"], stats["uptime_s"] / 0.01
    assert 0.75 * expected - 2 <= periods <= expected + 1, stats
