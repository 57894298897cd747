"""A staged rollout end to end on a small fleet: real `sim2edge-agent watch --tuf` devices (hardware revisions
``a`` and ``b``) polling a TUF repository served by nginx and reporting to mosquitto, and `sim2edge rollout`
judging them. A good version goes through every ring; a version the ``a`` devices refuse halts the canary ring
(the ``a`` devices), no ``b`` device ever sees it, and `rollout status` names the failed devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bundles import GATE_FAILED, GATE_PASSED, make_bundle, make_keys
from tests.bundles import publish as register
from tests.conftest import free_port, run_cli
from tests.servers import start_mosquitto, start_nginx, stop_nginx

pytestmark = [pytest.mark.slow,  # about 3 min on 2 cores: four agents installing, two rollouts with soaks
              pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("mosquitto")),
                                 reason="needs Debian's nginx and mosquitto (make nginx mosquitto)")]
DEVICES = {f"d{i}": "a" if i < 2 else "b" for i in range(4)}


@pytest.fixture()
def fleet(tmp_path, mlflow_server, prefect_harness):
    """nginx, mosquitto, a registered policy (v1, v2 good; v3 failed its gate), v1 published, four devices
    watching: yields (repo dir, broker URL, policy, device roots, reader password file, rings file)."""
    users = {**{d: f"pw-{d}" for d in DEVICES}, "sim2edge-reader": "pw-reader"}
    web, mq = tmp_path / "nginx", tmp_path / "mosquitto"
    web.mkdir()
    http_port, mqtt_port = free_port(), free_port()
    nginx = start_nginx(web, http_port)
    broker = start_mosquitto(mq, mqtt_port, users)
    priv, pub = make_keys(tmp_path)
    policy = f"fleet-{os.getpid()}-{time.monotonic_ns() % 100000}"
    for v, evaluation in (("1", GATE_PASSED), ("2", GATE_PASSED), ("3", GATE_FAILED)):
        tar = tmp_path / f"{policy}-{v}.tar"
        make_bundle(tar, priv, version=v, name=policy, evaluation=evaluation)
        register(mlflow_server, tar, policy)
    repo = web / "www" / "repo"
    done = run_cli("sim2edge", "publish", f"{policy}@1", "--repo", str(repo))
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "rings.yaml").write_text("rings:\n- {name: canary, match: {hw: a}}\n- {name: all}\n")
    (tmp_path / "reader.pw").write_text("pw-reader\n")
    agents, roots = [], {}
    for device, hw in DEVICES.items():
        roots[device] = tmp_path / "devices" / device
        (tmp_path / f"{device}.pw").write_text(f"pw-{device}\n")
        agents.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "sim2edge-agent"), "watch", policy, "--tuf",
             f"http://127.0.0.1:{http_port}/repo", "--tuf-root", str(repo / "metadata/root.json"),
             "--root", str(roots[device]), "--trust", str(pub), "--skip-target-check", "--interval", "1",
             "--jitter", "0", "--device-id", device, "--label", f"hw={hw}", "--report", f"mqtt://127.0.0.1:{mqtt_port}",
             "--fleet", "f", "--mqtt-password-file", str(tmp_path / f"{device}.pw"), "--attempts", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.realpath(r / "current").endswith("/1") for r in roots.values()):
            assert time.monotonic() < deadline, "the devices did not install v1"
            time.sleep(0.5)
        yield repo, f"mqtt://127.0.0.1:{mqtt_port}", policy, roots, tmp_path / "reader.pw", tmp_path / "rings.yaml"
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(timeout=30)
        broker.terminate()
        broker.wait(timeout=10)
        stop_nginx(web, nginx)


def rollout(fleet, version: str) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    repo, broker, policy, _, reader, rings = fleet
    return run_cli("sim2edge", "rollout", "start", f"{policy}@{version}", "--repo", str(repo), "--mqtt", broker,
                   "--fleet", "f", "--rings", str(rings), "--mqtt-password-file", str(reader), "--poll", "1",
                   "--soak", "2", "--min-devices", "2", "--abort-failed", "10", "--ring-timeout", "60",
                   "--max-polls", "120", env={"PREFECT_API_URL": PREFECT_API_URL.value()})


def versions(roots: dict) -> dict:
    return {d: os.path.realpath(r / "current").rsplit("/", 1)[-1] for d, r in roots.items()}


def test_a_good_version_rolls_through_and_a_bad_one_halts_in_its_ring(fleet):
    repo, broker, policy, roots, _, _ = fleet
    done = rollout(fleet, "2")
    assert done.returncode == 0 and f"rollout {policy} v2: done" in done.stdout, done.stdout[-3000:] + done.stderr
    assert set(versions(roots).values()) == {"2"}
    latest = json.loads((repo / "metadata/targets.json").read_text())["signed"]["targets"][f"{policy}/latest.tar"]
    assert latest["custom"]["sim2edge"]["version"] == "1"  # the rollout directs; latest.tar never moved

    halted = rollout(fleet, "3")
    assert halted.returncode == 1 and "halted ring canary: 2 of 2 devices failed" in halted.stdout, halted.stdout[-3000:]
    assert versions(roots) == {d: "2" for d in DEVICES}
    for device, hw in DEVICES.items():  # only ring canary (hw a) was offered v3, and refused it
        failed = json.loads((roots[device] / "failed.json").read_text()) if (roots[device] / "failed.json").exists() else {}
        assert (f"{policy}/3" in failed) == (hw == "a"), (device, failed)
    status = run_cli("sim2edge", "rollout", "status", policy, "--json")
    state = json.loads(status.stdout)
    assert state["status"] == "halted" and state["rings"][0]["failed_devices"] == ["d0", "d1"], state
    assert state["rings"][1]["status"] == "waiting"
    again = run_cli("sim2edge", "rollout", "abort", policy)
    assert again.returncode != 0 and "no running rollout" in again.stdout + again.stderr
