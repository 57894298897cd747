"""Device state reports over MQTT (edge/mqtt_report.py, registry/fleet_state.py) through a real mosquitto
on loopback, as this test's own process, with a password file (``mosquitto_passwd -U``) and an ACL that
lets each device write its own topic only; and the rings devices fall in (registry/rings.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from edge.mqtt_report import Broker, publish
from edge.rollout_plan import bucket
from registry.fleet_state import read_fleet
from registry.rings import RingSpec, assign, ring_of
from tests.bundles import make_keys, publish_versions
from tests.conftest import free_port, run_cli
from tests.servers import start_mosquitto

USERS = {"dev-a": "pw-a", "dev-b": "pw-b", "sim2edge-reader": "pw-r", "admin": "pw-admin"}
if not shutil.which("mosquitto"):
    pytest.skip("mosquitto is not installed (make mosquitto)", allow_module_level=True)


def start_broker(d: Path, port: int) -> subprocess.Popen:
    return start_mosquitto(d, port, USERS)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    port = free_port()
    proc = start_broker(tmp_path_factory.mktemp("mosquitto"), port)
    yield f"mqtt://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="module")
def policy(mlflow_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy")
    priv, pub = make_keys(tmp)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    publish_versions(mlflow_server, tmp, priv, name, 1, alias="champion")
    return name, pub


def agent_pull(mlflow_server, policy, root: Path, report: str, device: str, password: str, *extra: str):
    name, pub = policy
    (root.parent / f"{device}.pw").write_text(password + "\n")
    return run_cli("sim2edge-agent", "pull", f"{name}@champion", "--registry", mlflow_server, "--root", str(root),
                   "--trust", str(pub), "--skip-target-check", "--report", report, "--device-id", device,
                   "--mqtt-password-file", str(root.parent / f"{device}.pw"), "--attempts", "1", *extra)


def fleet(broker: str, name: str):
    return read_fleet(broker, name, "sim2edge-reader", USERS["sim2edge-reader"], settle_s=0.3)


def test_pull_reports_its_state_and_devices_lists_it_with_its_ring(broker, mlflow_server, policy, tmp_path):
    r = agent_pull(mlflow_server, policy, tmp_path / "a", broker, "dev-a", USERS["dev-a"], "--fleet", "f1",
                   "--label", "site=lab-1", "--label", "hw=orin")
    assert r.returncode == 0 and f"activated {policy[0]} v1" in r.stdout, r.stderr
    state = fleet(broker, "f1")
    (d,) = state.devices
    assert state.malformed == []
    assert (d.fleet, d.device, d.policy, d.version, d.health, d.runtime, d.missed_reports) == \
        ("f1", "dev-a", policy[0], "1", "ok", "onnxruntime (CPUExecutionProvider)", 0)
    assert d.labels == {"site": "lab-1", "hw": "orin"} and time.time() - d.time < 60
    (tmp_path / "rings.yaml").write_text("rings:\n  - {name: lab, match: {site: lab-1}}\n  - {name: rest}\n")
    out = run_cli("sim2edge", "devices", "--mqtt", broker, "--fleet", "f1", "--rings", str(tmp_path / "rings.yaml"),
                  env={"SIM2EDGE_MQTT_PASSWORD": USERS["sim2edge-reader"], "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if "dev-a" in line)
    assert " lab " in row and " ok " in row and "hw=orin,site=lab-1" in row, out.stdout
    js = run_cli("sim2edge", "devices", "--mqtt", broker, "--fleet", "f1", "--json",
                 env={"SIM2EDGE_MQTT_PASSWORD": USERS["sim2edge-reader"]})
    assert js.returncode == 0, js.stdout + js.stderr
    listed = json.loads(js.stdout)
    assert [(d["device"], d["ring"]) for d in listed["devices"]] == [("dev-a", None)] and listed["malformed"] == []
    refused = run_cli("sim2edge", "devices", "--mqtt", broker, "--fleet", "f1",
                      env={"SIM2EDGE_MQTT_PASSWORD": "wrong"})
    assert refused.returncode == 2 and "refused 'sim2edge-reader'" in refused.stdout, refused.stdout
    bad = run_cli("sim2edge-agent", "pull", "x@champion", "--registry", mlflow_server, "--trust", str(policy[1]),
                  "--root", str(tmp_path / "b"), "--label", "Site=lab")
    assert bad.returncode == 2 and "--label 'Site=lab'" in bad.stderr, bad.stderr


def test_a_wrong_password_is_refused_and_another_devices_id_is_dropped(broker):
    b = Broker("127.0.0.1", int(broker.rsplit(":", 1)[1]))
    with pytest.raises(OSError, match="refused 'dev-a'"):
        publish(b, "dev-a", "wrong", "sim2edge/f2/dev-a/state", b"{}", timeout_s=3)
    good = {"fleet": "f2", "device": "dev-a", "health": "none", "pull_failures": 0, "missed_reports": 0,
            "time": time.time()}
    publish(b, "dev-b", USERS["dev-b"], "sim2edge/f2/dev-a/state", json.dumps(good).encode())  # acked, then dropped
    assert fleet(broker, "f2").devices == []
    publish(b, "dev-a", USERS["dev-a"], "sim2edge/f2/dev-a/state", json.dumps(good).encode())
    assert [d.device for d in fleet(broker, "f2").devices] == ["dev-a"]


def test_a_busy_fleet_is_read_at_its_first_live_report_not_at_the_timeout(broker):
    """Reports arriving every 50 ms never leave 2 s of quiet: the read ends at the first live one, with every
    retained report in it."""
    b = Broker("127.0.0.1", int(broker.rsplit(":", 1)[1]))
    state = {"fleet": "f4", "health": "ok", "pull_failures": 0, "missed_reports": 0, "time": 1.0}
    for i in range(20):
        publish(b, "admin", USERS["admin"], f"sim2edge/f4/d{i}/state", json.dumps(dict(state, device=f"d{i}")).encode())
    stop_at = time.monotonic() + 8

    def chatter() -> None:
        while time.monotonic() < stop_at:
            publish(b, "admin", USERS["admin"], "sim2edge/f4/d0/state", json.dumps(dict(state, device="d0")).encode())
            time.sleep(0.05)

    talker = threading.Thread(target=chatter, daemon=True)
    talker.start()
    time.sleep(0.5)
    start = time.monotonic()
    read = read_fleet(broker, "f4", "sim2edge-reader", USERS["sim2edge-reader"], timeout_s=6, settle_s=2.0)
    took = time.monotonic() - start
    talker.join()
    assert len(read.devices) == 20 and took < 1.9, (len(read.devices), took)


def test_malformed_retained_messages_are_counted_and_named(broker):
    b = Broker("127.0.0.1", int(broker.rsplit(":", 1)[1]))
    good = {"fleet": "f3", "device": "dev-a", "health": "ok", "pull_failures": 0, "missed_reports": 0, "time": 1.0}
    for device, payload in (("dev-a", json.dumps(good)), ("dev-x", "not json {"),
                            ("dev-y", json.dumps(dict(good, device="dev-y", health="great"))),
                            ("dev-z", json.dumps(dict(good, device="dev-a"))),
                            ("dev-w", json.dumps(dict(good, device="dev-w", labels={"Bad": "x"})))):
        publish(b, "admin", USERS["admin"], f"sim2edge/f3/{device}/state", payload.encode())
    state = fleet(broker, "f3")
    assert [d.device for d in state.devices] == ["dev-a"]
    reasons = {m.topic.split("/")[2]: m.reason for m in state.malformed}
    assert set(reasons) == {"dev-w", "dev-x", "dev-y", "dev-z"}, reasons
    assert reasons["dev-x"].startswith("not JSON") and "field health" in reasons["dev-y"]
    assert "device 'dev-a'" in reasons["dev-z"] and "field labels" in reasons["dev-w"], reasons


def test_broker_down_at_install_queues_the_report_and_the_next_watch_poll_sends_it(mlflow_server, policy, tmp_path):
    port = free_port()
    root = tmp_path / "a"
    r = agent_pull(mlflow_server, policy, root, f"mqtt://127.0.0.1:{port}", "dev-a", USERS["dev-a"], "--fleet", "f4")
    assert r.returncode == 0 and f"activated {policy[0]} v1" in r.stdout, r.stderr
    assert "queued" in r.stderr and json.loads((root / "mqtt-report.json").read_text())["missed"] == 1
    proc = start_broker(tmp_path / "mosquitto", port)
    try:
        again = run_cli("sim2edge-agent", "watch", f"{policy[0]}@champion", "--registry", mlflow_server, "--root",
                        str(root), "--trust", str(policy[1]), "--skip-target-check", "--iterations", "1", "--report",
                        f"mqtt://127.0.0.1:{port}", "--fleet", "f4", "--device-id", "dev-a", "--mqtt-password-file",
                        str(tmp_path / "dev-a.pw"))
        assert again.returncode == 0 and "queued" not in again.stderr, again.stderr
        (d,) = fleet(f"mqtt://127.0.0.1:{port}", "f4").devices
        assert (d.version, d.health, d.missed_reports) == ("1", "ok", 1)
        assert not (root / "mqtt-report.json").exists()
    finally:
        stop(proc)


def test_rings_take_devices_by_labels_then_by_a_stable_share_of_the_fleet():
    spec = RingSpec.model_validate({"rings": [{"name": "lab", "match": {"site": "lab-1"}},
                                              {"name": "canary", "percent": 10},
                                              {"name": "early", "match": {"hw": "orin"}, "percent": 50},
                                              {"name": "rest"}]})
    ids = [f"dev-{i}" for i in range(2000)]
    rings = assign({d: {"hw": "orin"} for d in ids}, spec)
    assert rings == assign({d: {"hw": "orin"} for d in reversed(ids)}, spec)  # stable: by id alone
    share = {r: sum(v == r for v in rings.values()) / len(ids) for r in ("canary", "early", "rest")}
    assert abs(share["canary"] - 0.1) < 0.03 and abs(share["early"] - 0.4) < 0.04 and abs(share["rest"] - 0.5) < 0.04
    assert ring_of("dev-1", {"site": "lab-1"}, spec) == "lab"
    outside = next(d for d in ids if 10 <= bucket(d) < 50)
    assert ring_of(outside, {"hw": "jetson-nano"}, spec) == "rest"  # early needs hw=orin
    only = RingSpec.model_validate({"rings": [{"name": "lab", "match": {"site": "lab-1"}}]})
    assert ring_of("dev-1", {}, only) is None
    for bad, says in (({"rings": []}, "at least 1"), ({"rings": [{"name": "a"}, {"name": "a"}]}, "named twice"),
                      ({"rings": [{"name": "a", "percent": 120}]}, "less than or equal to 100"),
                      ({"rings": [{"name": "a", "match": {"Site": "x"}}]}, "Site")):
        with pytest.raises(ValidationError, match=says):
            RingSpec.model_validate(bad)


@pytest.mark.device
def test_the_agent_on_python38_reports_over_mqtt(broker, mlflow_server, policy, tmp_path):
    """JetPack 5's CPython 3.8 with the agent installed alone (extra ``mqtt``: paho-mqtt) publishes its state."""
    from tests.test_edge_pythons import edge_venv

    agent = str(edge_venv("3.8") / "bin" / "sim2edge-agent")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONWARNINGS": "ignore",
           "SIM2EDGE_MQTT_PASSWORD": USERS["dev-b"]}
    r = subprocess.run([agent, "pull", f"{policy[0]}@champion", "--registry", mlflow_server, "--root",
                        str(tmp_path / "a"), "--trust", str(policy[1]), "--skip-target-check", "--report", broker,
                        "--fleet", "f38", "--device-id", "dev-b", "--label", "python=3.8"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and f"activated {policy[0]} v1" in r.stdout, r.stderr
    (d,) = fleet(broker, "f38").devices
    assert (d.device, d.version, d.health, d.labels) == ("dev-b", "1", "ok", {"python": "3.8"})
