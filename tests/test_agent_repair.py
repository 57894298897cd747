"""``sim2edge-agent repair`` (and ``watch``, which runs it before each poll): installed copies that no longer
verify are downloaded again and swapped in; ``current`` is never touched; a kill at any step leaves
``current`` as it was and the next repair finishes. Real MLflow server on loopback."""

from __future__ import annotations

import shutil
import uuid

import pytest
from mlflow.tracking import MlflowClient

from edge import bundle, crash, repair, signing
from edge.errors import CheckFailed
from edge.pull import pull, rollback, watch
from edge.store import DeviceStore, make_writable
from tests.bundles import FaultProxy, make_keys, publish_versions
from tests.conftest import free_port, run_cli
from tests.test_agent_failed import FAST, damage


@pytest.fixture()
def installed(mlflow_server, tmp_path):
    """Versions 1..3 of a tiny policy pulled in order: current v3, previous v2, v1 installed."""
    priv, pub = make_keys(tmp_path)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp_path, priv, name, 3)
    trusted, root = signing.load_trusted([pub]), tmp_path / "store"
    for v in "123":
        pull(f"{name}@{v}", mlflow_server, root, trusted, skip_target_check=True, options=FAST)
    return name, pub, trusted, DeviceStore(root)


def agent(store: DeviceStore, pub, registry: str, **env):
    return run_cli("sim2edge-agent", "repair", "--registry", registry, "--root", str(store.root), "--trust", str(pub),
                   "--attempts", "2", "--retry-base", "0.01", env=env)


def test_watch_repairs_a_damaged_previous_and_rollback_works_again(mlflow_server, installed):
    name, _, trusted, store = installed
    proxy = FaultProxy(mlflow_server)
    try:
        previous, current = store.link("previous"), store.link("current")
        damage(previous / "policy.onnx")
        with pytest.raises(CheckFailed, match=r"^hash: 'policy\.onnx' sha256 does not match the manifest$"):
            rollback(store.root, trusted)
        watch(f"{name}@3", proxy.url, store.root, trusted, interval_s=0, skip_target_check=True, options=FAST,
              iterations=2)
        assert len(proxy.log) == 1, proxy.log  # v2 once; the second poll found nothing to repair
    finally:
        proxy.close()
    assert store.link("current") == current and store.link("previous") == previous
    assert bundle.verify_dir(previous, trusted)["policy"]["version"] == "2"
    (event,) = [e for e in store.history() if e["event"] == "repaired"]
    assert event["version"] == "2" and "policy.onnx" in event["detail"] and len(event["bundle_sha256"]) == 64
    assert not list((store.root / "tmp").iterdir()) and not list((store.root / "downloads").iterdir())
    assert rollback(store.root, trusted) == previous


def test_repair_command_fixes_every_copy_but_current(mlflow_server, installed):
    name, pub, trusted, store = installed
    v1, v2, v3 = (store.bundle_dir(name, v) for v in "123")
    damage(v1 / "golden.npz")
    make_writable(v2)
    shutil.rmtree(v2)  # previous gone: the store never removes it, a failing disk may
    damage(v3 / "policy.onnx")
    down = agent(store, pub, f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 3 and "unreachable" in down.stderr and not v2.exists(), down.stderr
    r = agent(store, pub, mlflow_server)
    assert r.returncode == 0, r.stderr
    assert f"repaired {name} v1" in r.stdout and f"repaired {name} v2" in r.stdout and "v3" not in r.stdout
    assert bundle.verify_dir(v1, trusted) and bundle.verify_dir(v2, trusted)
    with pytest.raises(CheckFailed, match=r"^hash: 'policy\.onnx' sha256 does not match the manifest$"):
        bundle.verify_dir(v3, trusted)  # current: never replaced behind the running policy's back
    assert store.link("current") == v3
    again = agent(store, pub, mlflow_server)
    assert again.returncode == 0 and "nothing to repair" in again.stdout
    # a version the registry no longer has: journaled, left in place, exit 1
    MlflowClient(mlflow_server).delete_model_version(name, "1")
    damage(v1 / "golden.npz")
    gone = agent(store, pub, mlflow_server)
    assert gone.returncode == 1 and f"not repaired: {name} v1" in gone.stderr, gone.stderr
    assert v1.is_dir() and store.history()[-1]["event"] == "repair-failed"


def test_kill_at_every_repair_step_keeps_current_and_the_next_repair_finishes(mlflow_server, installed):
    name, pub, trusted, store = installed
    current, previous = store.link("current"), store.link("previous")
    for step in repair.STEPS:
        damage(previous / "policy.onnx")
        killed = agent(store, pub, mlflow_server, **{crash.ENV: step})
        assert killed.returncode == -9, (step, killed.stderr)
        assert store.link("current") == current and bundle.verify_dir(current, trusted), step
        fixed = agent(store, pub, mlflow_server)
        assert fixed.returncode == 0 and f"repaired {name} v2" in fixed.stdout, (step, fixed.stdout, fixed.stderr)
        assert store.link("previous") == previous and bundle.verify_dir(previous, trusted), step
    assert not list((store.root / "tmp").iterdir())
