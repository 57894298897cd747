"""Hardware-in-the-loop: the real-time twin drives a real ``sim2edge-agent run`` over a direct and an impaired link.

The device serves a linear cart-pole balancer (the one of tests/test_evaluate.py) from a real signed bundle;
the host runs the twin at the task's 20 ms period. Episodes are cut to 60 steps (1.2 s) to keep the file fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edge import bundle, signing
from edge.runtime import OnnxRuntime
from stages.artifacts import ExportedPolicy
from stages.twin.episodes import run_episodes
from stages.twin.hil import HilConfig, hil_task, run_hil, substep_actions, twin_env
from stages.twin.relay import Impairment, Relay, fates
from stages.twin.suite import Scenario
from tests.bundles import linear_onnx, make_bundle, make_keys
from tests.test_agent_run import AGENT
from tests.test_evaluate import BALANCER, LATENCY_FRAGILE

STEPS, EPISODES, SEED = 60, 3, 1000
CLONE_NEWNET = 0x40000000
CARTPOLE_IO = {"input": {"terms": [{"name": n, "unit": "1"} for n in
                                   ("cart_pos", "pole_cos", "pole_sin", "cart_vel", "pole_angvel")]},
               "output": {"terms": [{"name": "slide", "unit": "N"}], "low": [-1.0], "high": [1.0], "default": [0.0]}}


def cartpole_store(tmp_path: Path, k=BALANCER, exported: ExportedPolicy | None = None,
                   version: str = "1") -> tuple[Path, Path]:
    """A device store whose active bundle (balancer ``version``) is the linear controller ``clip(obs · k, -1, 1)``,
    or ``exported`` (a trained cart-pole policy's ONNX and golden file) where given; returns (store, onnx)."""
    from edge.store import DeviceStore

    onnx = tmp_path / "policy.onnx"
    if exported is None:
        w = np.asarray(k, np.float32).reshape(5, 1)
        x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
        buf = io.BytesIO()
        np.savez(buf, inputs=x, outputs=np.clip(x @ w, -1, 1))
        onnx.write_bytes(linear_onnx(w))
        golden = buf.getvalue()
    else:
        onnx.write_bytes(exported.path.read_bytes())
        golden = exported.golden.read_bytes()
    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv, files={"policy.onnx": onnx.read_bytes(), "golden.npz": golden},
                io=CARTPOLE_IO, period_s=0.02, name="balancer", version=version)
    store = DeviceStore(tmp_path / "store")
    staged = store.staging_dir()
    bundle.extract(tmp_path / "b.tar", staged, 1 << 24)
    bundle.verify_dir(staged, signing.load_trusted([pub]))
    store.activate(store.install(staged, "balancer", version))
    return store.root, onnx


def serve(root: Path, listen: str, prefix: tuple[str, ...] = (), version: str = "1") -> tuple[subprocess.Popen, str]:
    """``sim2edge-agent run`` (its watchdog out of the way: every action it sends answers an observation)."""
    proc = subprocess.Popen([*prefix, AGENT, "run", "--root", str(root), "--listen", listen, "--watchdog-periods",
                             "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith(f"serving balancer v{version} on "):
        proc.kill()
        pytest.fail(f"the agent did not start: {line}{proc.communicate(timeout=10)[1]}")
    return proc, line.split(" on ", 1)[1].split(" ")[0]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)


def in_process(onnx: Path, steps: int = STEPS, episodes: int = EPISODES):
    """The same episodes evaluated in-process (no link, the action in effect from the period's first substep)."""
    env = twin_env(hil_task("cartpole", steps), Scenario(name="nominal"), hil_task("cartpole").nominal_params(), SEED,
                   episodes)
    return run_episodes(OnnxRuntime(onnx), env)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, Path]:
    return cartpole_store(tmp_path_factory.mktemp("hil"))


@pytest.fixture(scope="module")
def device(store):
    root, onnx = store
    proc, address = serve(root, "udp://127.0.0.1:0")
    yield address, onnx
    stop(proc)


def test_clean_link_keeps_deadlines_and_matches_in_process_returns(device):
    address, onnx = device
    r = run_hil(HilConfig(device=address, episodes=EPISODES, seed=SEED, max_steps=STEPS), "cartpole")
    expected = in_process(onnx).returns
    assert [e.steps for e in r.episodes] == [STEPS] * EPISODES and not any(e.fell for e in r.episodes)
    periods = EPISODES * STEPS
    assert r.total("deadline_misses") <= 0.1 * periods, r.episodes  # ≈ 0; slack for a loaded host
    # on loopback an action is lost only where the device, waking late, found two observations and kept the newer
    assert r.total("lost_actions") <= r.device_delta("dropped_stale") and r.total("duplicate_actions") == 0
    assert r.rtt_ms()["p50"] < 0.5 * r.period_s * 1e3
    # the action lands a substep (10 ms) later than in-process: returns stay within a few percent
    assert r.returns == pytest.approx(expected, rel=0.05), (r.returns, expected)
    row = r.summary(SEED)
    assert row["episodes"] == EPISODES and row["steps"] == periods and row["falls"] == 0
    assert row["mean_return_ci95"][0] <= row["mean_return"] <= row["mean_return_ci95"][1]
    assert row["deadline_misses"] == row["late_actions"] + row["lost_actions"] and row["rtt_ms_p99"] <= row["rtt_ms_max"]


def test_unix_socket_device(store, tmp_path):
    proc, address = serve(store[0], f"unix://{tmp_path}/agent.sock")
    try:
        r = run_hil(HilConfig(device=address, episodes=1, seed=SEED, max_steps=30), "cartpole")
    finally:
        stop(proc)
    assert r.episodes[0].steps == 30 and r.total("deadline_misses") <= 3 and len(r.episodes[0].rtt_ms) >= 27


def test_an_action_holds_from_the_substep_it_arrives_at():
    old, new, newer = np.zeros(1), np.ones(1), np.full(1, 2.0)
    per, after = substep_actions(old, [(1, new)], 2)
    assert per.ravel().tolist() == [0, 1] and after == new
    per, after = substep_actions(old, [(2, new)], 2)  # arrived in the period's last instant: from the next period
    assert per.ravel().tolist() == [0, 0] and after == new
    per, after = substep_actions(old, [(0, new), (1, newer)], 2)
    assert per.ravel().tolist() == [1, 2] and after == newer


def test_duplicated_and_overtaken_actions_are_counted_not_applied(device):
    address, _ = device
    down = Impairment(duplicate=0.2, reorder=0.2, reorder_s=0.03)  # held back beyond the period: the next overtakes it
    with Relay(address, Impairment(), down, seed=4) as relay:
        r = run_hil(HilConfig(device=relay.address, episodes=2, seed=SEED, max_steps=STEPS), "cartpole")
    c = relay.counters["down"]
    assert 0 < r.total("duplicate_actions") <= c.duplicated and 0 < r.total("stale_actions") <= c.reordered
    assert r.total("late_actions") >= r.total("stale_actions"), r.episodes


def test_latency_fragile_policy_falls_over_a_link_in_process_evaluation_does_not_have(tmp_path):
    """tests/test_evaluate.py's fragile balancer: no fall in-process; 10 ms each way (a round trip over a period) fells it."""
    root, onnx = cartpole_store(tmp_path, LATENCY_FRAGILE)
    assert not in_process(onnx, 100, 2).fell.any()
    proc, address = serve(root, "udp://127.0.0.1:0")
    try:
        with Relay(address, Impairment(delay_s=0.01), seed=2) as relay:
            r = run_hil(HilConfig(device=relay.address, episodes=2, seed=SEED, max_steps=100), "cartpole")
    finally:
        stop(proc)
    assert r.rtt_ms()["p50"] > r.period_s * 1e3 and any(e.fell for e in r.episodes), r.episodes


def test_relay_fates_are_seeded():
    imp = Impairment(delay_s=0.01, jitter_s=0.003, loss=0.05, duplicate=0.02, reorder=0.02)
    draw = lambda seed: list(itertools.islice(fates(imp, np.random.default_rng(seed)), 2000))  # noqa: E731
    a, b = draw(7), draw(7)
    assert a == b and a != draw(8)
    assert 0.03 < np.mean([f.drop for f in a]) < 0.07 and all(0.007 <= f.delay_s <= 0.023 for f in a)
    assert 0.01 < np.mean([f.copies == 2 for f in a]) < 0.03 and 0.01 < np.mean([f.held_back for f in a]) < 0.03


def test_lossy_link_loses_what_the_relay_dropped(device):
    address, _ = device
    with Relay(address, Impairment(loss=0.15), seed=3) as relay:
        r = run_hil(HilConfig(device=relay.address, episodes=2, seed=SEED, max_steps=STEPS), "cartpole")
    dropped = relay.counters["up"].dropped + relay.counters["down"].dropped
    assert dropped > 0.15 * (relay.counters["up"].forwarded + relay.counters["up"].dropped)
    probes_lost = sum(e.phase.probes_sent - e.phase.probes_answered for e in r.episodes)
    # every datagram the relay dropped is an observation or action lost; the device may have skipped a stale one more
    assert 0 <= r.total("lost_actions") + probes_lost - dropped <= r.device_delta("dropped_stale"), r.episodes
    assert r.total("deadline_misses") >= r.total("lost_actions") > 0.15 * sum(e.steps for e in r.episodes)


def test_delay_beyond_the_period_makes_every_action_late(device):
    address, _ = device
    with Relay(address, Impairment(delay_s=0.025), Impairment(), seed=1) as relay:
        r = run_hil(HilConfig(device=relay.address, episodes=2, seed=SEED, max_steps=STEPS), "cartpole")
    steps = sum(e.steps for e in r.episodes)
    assert relay.counters["up"].delayed >= steps and relay.counters["down"].delayed == 0
    assert r.rtt_ms()["p50"] > r.period_s * 1e3 and r.total("late_actions") >= 0.9 * steps, r.episodes
    assert r.total("lost_actions") <= r.device_delta("dropped_stale")


@contextlib.contextmanager
def entered(netns: str):
    """Run this thread in the network namespace ``netns`` (sockets made meanwhile stay there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{netns}") as there:
        if libc.setns(there.fileno(), CLONE_NEWNET):
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            yield
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


@pytest.fixture
def namespaces():
    """A "host" and a "device" namespace joined by a veth pair, 10.77.0.1 ↔ 10.77.0.2; deleted afterwards."""
    host, dev = f"s2e-hil-h{os.getpid()}", f"s2e-hil-d{os.getpid()}"
    made = []
    try:
        for ns in (host, dev):
            r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"network namespaces (ip netns add) not permitted here: {r.stderr.strip()}")
            made.append(ns)
        for cmd in (f"-n {host} link add vh type veth peer name vd netns {dev}",
                    f"-n {host} addr add 10.77.0.1/30 dev vh", f"-n {dev} addr add 10.77.0.2/30 dev vd",
                    f"-n {host} link set vh up", f"-n {dev} link set vd up",
                    f"-n {host} link set lo up", f"-n {dev} link set lo up"):
            subprocess.run(["ip", *cmd.split()], check=True)
        yield host, dev
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], check=True)


def test_device_in_its_own_network_namespace_behind_a_veth_and_the_relay(store, namespaces):
    host, dev = namespaces
    root, _ = store
    proc, address = serve(root, "udp://10.77.0.2:0", prefix=("ip", "netns", "exec", dev))
    try:
        with entered(host):
            direct = run_hil(HilConfig(device=address, episodes=1, seed=SEED, max_steps=STEPS), "cartpole")
            with Relay(address, Impairment(delay_s=0.004, jitter_s=0.002, loss=0.05), seed=5,
                       listen="udp://10.77.0.1:0") as relay:
                shaped = run_hil(HilConfig(device=relay.address, episodes=1, seed=SEED, max_steps=STEPS), "cartpole")
    finally:
        stop(proc)
    assert direct.total("deadline_misses") <= 0.1 * sum(e.steps for e in direct.episodes), direct.episodes
    assert direct.device_after["observations"] > 0
    dropped = relay.counters["up"].dropped + relay.counters["down"].dropped
    probes_lost = sum(e.phase.probes_sent - e.phase.probes_answered for e in shaped.episodes)
    assert dropped > 0 and relay.counters["up"].delayed > 0
    assert 0 <= shaped.total("lost_actions") + probes_lost - dropped <= shaped.device_delta("dropped_stale")
    assert shaped.rtt_ms()["p50"] > direct.rtt_ms()["p50"] + 5  # the relay's ~8 ms round trip shows
