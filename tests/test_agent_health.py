"""Automatic rollback when the health check fails after ``current`` has switched.

Fault: ``SIM2EDGE_AGENT_CORRUPT_AT=switched:<file>`` (edge/crash.py) truncates a file of the new
bundle right after the atomic switch, as storage going bad between the smoke test and the first
load through ``current`` would. The real runtime then fails to load it from ``current``; the agent
must switch back atomically, journal it, remove the untrusted bundle and let a later pull succeed.
"""

from __future__ import annotations

import os
import uuid

import pytest

from edge import bundle, crash, signing
from edge.errors import CheckFailed
from edge.pull import PullOptions, pull, rollback
from edge.registry_client import TransferOptions
from edge.store import DeviceStore
from tests.bundles import make_keys, publish_versions
from tests.conftest import run_cli

FAST = PullOptions(TransferOptions(attempts=2, backoff_base_s=0.01, timeout_s=5))


@pytest.fixture()
def policy(mlflow_server, tmp_path):
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp_path, priv, name, 3)
    return name, signing.load_trusted([pub]), pub


def _pull(name, version, url, root, trusted):
    return pull(f"{name}@{version}", url, root, trusted, skip_target_check=True, options=FAST)


@pytest.mark.parametrize("member", ["policy.onnx", "golden.npz"])
def test_health_failure_after_the_switch_rolls_back(mlflow_server, policy, tmp_path, monkeypatch, member):
    name, trusted, _ = policy
    root = tmp_path / "store"
    _pull(name, 1, mlflow_server, root, trusted)
    _pull(name, 2, mlflow_server, root, trusted)
    store = DeviceStore(root)
    links = os.readlink(root / "current"), os.readlink(root / "previous")
    monkeypatch.setenv(crash.CORRUPT_ENV, f"switched:{member}")
    with pytest.raises(CheckFailed, match=rf"^health: {name} v3 failed its health check after activation .*"
                                          rf"current restored to .*/bundles/{name}/2"):
        _pull(name, 3, mlflow_server, root, trusted)
    assert (os.readlink(root / "current"), os.readlink(root / "previous")) == links
    assert bundle.verify_dir(store.link("current"), trusted)["policy"]["version"] == "2"
    assert not store.bundle_dir(name, "3").exists(), "the bundle that failed after install was kept"
    event = store.history()[-1]
    assert event["event"] == "health-rollback" and event["version"] == "3" and event["restored"].endswith("/2")
    assert not list((root / "tmp").iterdir()) and not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    # the fault is gone: the same bundle is known bad until asked for explicitly, then downloads and activates
    monkeypatch.delenv(crash.CORRUPT_ENV)
    with pytest.raises(CheckFailed, match=rf"^known-bad: {name} v3 .*failed its health check 1 time\(s\)"):
        _pull(name, 3, mlflow_server, root, trusted)
    assert pull(f"{name}@3", mlflow_server, root, trusted, skip_target_check=True,
                options=PullOptions(FAST.transfer, retry_failed=True)).changed
    assert store.current_manifest()["policy"]["version"] == "3"
    assert store.history()[-1]["runtime"] == "onnxruntime (CPUExecutionProvider)"


def test_first_install_failing_its_health_check_leaves_no_policy_active(mlflow_server, policy, tmp_path):
    name, _, pub = policy
    root = tmp_path / "store"
    r = run_cli("sim2edge-agent", "pull", f"{name}@1", "--registry", mlflow_server, "--root", str(root),
                "--trust", str(pub), "--skip-target-check", env={crash.CORRUPT_ENV: "switched:policy.onnx"})
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "health:" in r.stderr and "current restored to none" in r.stderr and "Protobuf parsing failed" in r.stderr  # the runtime chain names the cause
    assert not (root / "current").is_symlink() and not (root / "previous").is_symlink()
    assert DeviceStore(root).installed(name) == []
    assert [e["event"] for e in DeviceStore(root).history()] == ["health-rollback"]
    status = run_cli("sim2edge-agent", "status", "--root", str(root))
    assert status.returncode == 1 and "no active policy" in status.stdout


def test_rollback_failing_its_health_check_keeps_current(mlflow_server, policy, tmp_path, monkeypatch):
    name, trusted, _ = policy
    root = tmp_path / "store"
    _pull(name, 1, mlflow_server, root, trusted)
    _pull(name, 2, mlflow_server, root, trusted)
    links = os.readlink(root / "current"), os.readlink(root / "previous")
    monkeypatch.setenv(crash.CORRUPT_ENV, "switched:policy.onnx")
    with pytest.raises(CheckFailed, match=rf"^health: {name} v1 failed its health check .*restored to .*/2"):
        rollback(root, trusted)
    assert (os.readlink(root / "current"), os.readlink(root / "previous")) == links
    assert DeviceStore(root).history()[-1]["event"] == "health-rollback"
