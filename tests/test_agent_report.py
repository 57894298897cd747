"""``watch`` reports the device's state to the registry (edge/report.py); registry/devices.py and
``sim2edge devices`` read it back. Against the real MLflow server on loopback, and against a registry
that is down or never answers (the watch must go on, and report later)."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
from mlflow.tracking import MlflowClient

from edge import crash, signing
from edge.pull import PullOptions, watch
from edge.registry_client import TransferOptions
from edge.report import Reporter, device_state, tag_key
from edge.store import DeviceStore
from registry.devices import devices
from tests.bundles import active_store, make_keys, publish_versions
from tests.conftest import free_port, run_cli

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
                "--iterations", "2", "--device-id", "jetson 7/a")
    assert r.returncode == 0 and f"activated {name} v2" in r.stdout, r.stderr
    tags = MlflowClient(mlflow_server).get_registered_model(name).tags
    assert set(k for k in tags if k.startswith("sim2edge.device.")) == {"sim2edge.device.jetson_7_a"}
    (d,) = devices(MlflowClient(mlflow_server), name)
    assert (d.device, d.policy, d.version, d.health, d.runtime) == \
        ("jetson 7/a", name, "2", "ok", "onnxruntime (CPUExecutionProvider)")
    assert d.hostname == socket.gethostname() and 0 <= d.age_s < 60 and d.missed_reports == 0
    assert d.last_error is None and d.pull_failures == 0
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
        reporter = Reporter(root, "http://127.0.0.1:%d" % silent.getsockname()[1], "tiny", "dev", [], timeout_s=0.3)
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
