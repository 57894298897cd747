"""Versions that fail on the device are remembered by digest (``<root>/failed.json``) and not downloaded again;
damaged stored copies heal by a fresh download; a damaged ``current`` is never removed by a pull.

Faults, against a real MLflow server on loopback (downloads counted by a pass-through proxy): a health check
failing after the switch (``SIM2EDGE_AGENT_CORRUPT_AT``), a golden mismatch in the smoke test, a stored copy
damaged after an agent was killed before activating it, a damaged active bundle.
"""

from __future__ import annotations

import json
import uuid

import pytest
from mlflow.tracking import MlflowClient

from edge import bundle, crash, signing
from edge.errors import CheckFailed
from edge.pull import PullOptions, pull, watch
from edge.registry_answers import TAG_SHA256
from edge.registry_client import TransferOptions
from edge.report import device_state
from edge.store import DeviceStore
from registry import models
from tests.bundles import (FaultProxy, golden, log_bundle, make_bundle, make_keys, publish, publish_versions,
                           signed_gate, tiny_onnx)
from tests.conftest import run_cli

FAST = PullOptions(TransferOptions(attempts=2, backoff_base_s=0.01, timeout_s=5))


@pytest.fixture()
def policy(mlflow_server, tmp_path):
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp_path, priv, name, 2)
    return name, priv, pub


@pytest.fixture()
def proxy(mlflow_server):
    p = FaultProxy(mlflow_server)
    yield p
    p.close()


def downloads(proxy: FaultProxy) -> int:
    return len(proxy.log)


def republish(url: str, tar, name: str, version: str) -> None:
    """Point an existing registry version at a new bundle (a new digest for the same version), with the
    pipeline's tag writer (``registry.models.publish``)."""
    client = MlflowClient(url)
    _, path = log_bundle(client, tar)
    champion = models.current_champion(client, name)
    assert models.publish(client, name, version, path, bundle.sha256_path(tar), tar.stat().st_size, signed_gate(tar),
                          {}, champion) == ("champion" if champion == version else "challenger")


def damage(path) -> None:
    """Flip a byte in the middle of ``path``."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(data))


def test_health_failing_version_is_downloaded_once_until_its_digest_changes(mlflow_server, proxy, policy, tmp_path,
                                                                             monkeypatch, capfd):
    name, priv, pub = policy
    trusted, root = signing.load_trusted([pub]), tmp_path / "store"
    store = DeviceStore(root)
    pull(f"{name}@1", proxy.url, root, trusted, skip_target_check=True, options=FAST)
    monkeypatch.setenv(crash.CORRUPT_ENV, "switched:policy.onnx")
    watch(f"{name}@champion", proxy.url, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=3)
    assert downloads(proxy) == 2, proxy.log  # v1, then v2 once
    assert store.current_manifest()["policy"]["version"] == "1"
    sha = MlflowClient(mlflow_server).get_model_version(name, "2").tags[TAG_SHA256]
    entry = store.failed_versions()[f"{name}/2"]
    assert (entry["check"], entry["count"], entry["bundle_sha256"]) == ("health", 1, sha)
    err = capfd.readouterr().err
    assert err.count("known-bad:") == 1 and "failed its health check 1 time(s)" in err, err
    refused = [e for e in store.history() if e["event"] == "refused"]
    assert [e["check"] for e in refused] == ["known-bad"], refused  # journaled once, not per poll
    state = device_state(store, trusted, "dev")
    assert (state["last_refusal"]["version"], state["last_refusal"]["check"]) == ("2", "health")
    status = run_cli("sim2edge-agent", "status", "--root", str(root), "--json")
    assert json.loads(status.stdout)["known_bad"] == [f"{name} v2 (health, 1x, sha256 {sha[:12]})"], status.stdout
    # the fault is gone, but the registry still offers the same digest: still not downloaded
    monkeypatch.delenv(crash.CORRUPT_ENV)
    watch(f"{name}@champion", proxy.url, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=1)
    assert downloads(proxy) == 2
    # a fixed bundle for the same version (new digest): downloaded, activated, forgotten as failed
    make_bundle(tmp_path / "fixed.tar", priv, version="2", name=name, pad_bytes=1000)
    republish(mlflow_server, tmp_path / "fixed.tar", name, "2")
    watch(f"{name}@champion", proxy.url, root, trusted, interval_s=0, skip_target_check=True, options=FAST,
          iterations=2)
    assert downloads(proxy) == 3 and store.current_manifest()["policy"]["version"] == "2"
    assert store.failed_versions() == {} and device_state(store, trusted, "dev")["last_refusal"] is None
    assert store.history()[-1]["bundle_sha256"] == bundle.sha256_path(tmp_path / "fixed.tar")


def test_smoke_failing_version_needs_retry_failed_and_a_new_version_activates(mlflow_server, proxy, policy,
                                                                              tmp_path):
    name, priv, pub = policy
    root = tmp_path / "store"
    make_bundle(tmp_path / "bad.tar", priv, version="3", name=name,
                files={"policy.onnx": tiny_onnx(0.5), "golden.npz": golden(0.9)})
    publish(mlflow_server, tmp_path / "bad.tar", name, "champion")

    def agent_pull(*extra):
        return run_cli("sim2edge-agent", "pull", f"{name}@champion", "--registry", proxy.url, "--root", str(root),
                       "--trust", str(pub), "--skip-target-check", *extra)

    first = agent_pull()
    assert first.returncode == 1 and "smoke: golden outputs differ" in first.stderr, first.stderr
    second = agent_pull()
    assert second.returncode == 1 and downloads(proxy) == 1, (second.stderr, proxy.log)
    assert "known-bad:" in second.stderr and "failed its smoke check 1 time(s)" in second.stderr
    assert "--retry-failed" in second.stderr
    third = agent_pull("--retry-failed")
    assert third.returncode == 1 and "smoke:" in third.stderr and downloads(proxy) == 2
    assert json.loads((root / "failed.json").read_text())[f"{name}/3"]["count"] == 2
    assert not (root / "current").is_symlink() and DeviceStore(root).installed(name) == []
    make_bundle(tmp_path / "good.tar", priv, version="4", name=name)
    publish(mlflow_server, tmp_path / "good.tar", name, "champion")
    fixed = agent_pull()
    assert fixed.returncode == 0 and f"activated {name} v4" in fixed.stdout, fixed.stderr


def test_damaged_stored_copy_is_removed_and_downloaded_again(mlflow_server, proxy, policy, tmp_path):
    name, _, pub = policy
    trusted, root = signing.load_trusted([pub]), tmp_path / "store"
    store = DeviceStore(root)
    pull(f"{name}@1", proxy.url, root, trusted, skip_target_check=True, options=FAST)
    killed = run_cli("sim2edge-agent", "pull", f"{name}@2", "--registry", proxy.url, "--root", str(root),
                     "--trust", str(pub), "--skip-target-check", env={crash.ENV: "installed"})
    assert killed.returncode == -9, killed.stderr
    stored = store.bundle_dir(name, "2")
    assert stored.is_dir() and store.link("current") == store.bundle_dir(name, "1") and downloads(proxy) == 2
    damage(stored / "golden.npz")
    for part in (root / "downloads").iterdir():
        part.unlink()  # the kept download went too: the copy must come from the registry again
    result = pull(f"{name}@2", proxy.url, root, trusted, skip_target_check=True, options=FAST)
    assert result.changed and result.download is not None and downloads(proxy) == 3
    assert store.link("current") == stored and bundle.verify_dir(stored, trusted)["policy"]["version"] == "2"
    discarded = [e for e in store.history() if e["event"] == "discarded"]
    assert len(discarded) == 1 and "golden.npz" in discarded[0]["detail"], discarded
    assert store.failed_versions() == {}


def test_damaged_current_is_never_removed_by_pull(mlflow_server, proxy, policy, tmp_path):
    name, _, pub = policy
    trusted, root = signing.load_trusted([pub]), tmp_path / "store"
    store = DeviceStore(root)
    pull(f"{name}@1", proxy.url, root, trusted, skip_target_check=True, options=FAST)
    current = store.link("current")
    damage(current / "policy.onnx")
    for _ in range(2):
        with pytest.raises(CheckFailed, match=rf"^corrupt: the active {name} v1 at .* fails verification "
                                              rf"\(hash: .*policy.onnx.*pull never removes `current`"):
            pull(f"{name}@1", proxy.url, root, trusted, skip_target_check=True, options=FAST)
    assert current.is_dir() and store.link("current") == current and downloads(proxy) == 1
    assert [e["check"] for e in store.history() if e["event"] == "refused"] == ["corrupt"]
    assert device_state(store, trusted, "dev")["health"] == "corrupt"
    # a newer version replaces it; the damaged copy stays as previous, for the operator to look at
    assert pull(f"{name}@2", proxy.url, root, trusted, skip_target_check=True, options=FAST).changed
    assert store.link("previous") == current and current.is_dir()
    assert device_state(store, trusted, "dev")["health"] == "ok"
