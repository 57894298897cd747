"""``sim2edge-agent run`` driven over its socket from a test client, and ``sim2edge-agent bench``.

The loop runs as a real subprocess serving a real ONNX Runtime session; the client speaks the
wire format documented in edge/control.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge.control import FRESH, FRESH_ACTIONS, SAFE_DEFAULT, STATS_MAGIC, WATCHDOG, decode_action, encode_observation
from tests.bundles import active_store
from tests.conftest import run_cli

AGENT = str(Path(sys.executable).parent / "sim2edge-agent")


def start(root: Path, *args: str, serving: str = "tiny v1") -> tuple[subprocess.Popen, str]:
    """``sim2edge-agent run`` on the store at ``root``; returns the process and its bound address."""
    proc = subprocess.Popen([AGENT, "run", "--root", str(root), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith(f"serving {serving} on "), line + proc.stderr.read()
    return proc, line.split(" on ", 1)[1].split(" ")[0]


class Client:
    def __init__(self, address: str, tmp: Path) -> None:
        if address.startswith("udp://"):
            host, _, port = address[6:].rpartition(":")
            self.sock, self.peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM), (host, int(port))
        else:
            self.sock, self.peer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM), address[7:]
            self.sock.bind(str(tmp / "client.sock"))  # a Unix datagram client needs an address for replies
        self.sock.settimeout(2.0)

    def act(self, seq: int, obs) -> tuple:
        self.sock.sendto(encode_observation(seq, time.monotonic(), np.asarray(obs, np.float32)), self.peer)
        while True:
            got = decode_action(self.sock.recv(65536))
            if got[0] == seq:
                return got

    def stats(self) -> dict:
        self.sock.sendto(STATS_MAGIC, self.peer)
        while True:
            data = self.sock.recv(65536)
            if data.startswith(STATS_MAGIC):
                return json.loads(data[4:])


def test_run_loop_over_udp_clamps_guards_and_watches(tmp_path):
    root = active_store(tmp_path, period_s=0.01)
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--watchdog-periods", "10")
    try:
        client = Client(address, tmp_path)
        seq, stamp, flags, action = client.act(1, np.full(5, 0.2))
        assert (seq, flags) == (1, FRESH) and action == pytest.approx([0.5])  # 0.5 * sum(obs); a new process's
        assert client.act(2, np.full(5, 10.0))[3] == pytest.approx([0.8])      # graph 1.0, manifest limit 0.8
        assert client.act(3, np.full(5, -10.0))[3] == pytest.approx([-0.5])
        nan = np.zeros(5, np.float32)
        nan[2] = np.nan
        seq, _, flags, action = client.act(4, nan)
        assert seq == 4 and flags & SAFE_DEFAULT and action == pytest.approx([0.1])
        seq, _, flags, action = client.act(5, np.array([0, np.inf, 0, 0, 0], np.float32))
        assert flags & SAFE_DEFAULT and action == pytest.approx([0.1])
        client.sock.sendto(encode_observation(6, 0.0, np.zeros(4, np.float32)), client.peer)  # wrong size
        client.sock.sendto(b"hello", client.peer)
        # silence: after 10 periods the watchdog sends the default, flagged, answering the last seq
        quiet = time.monotonic()
        got = decode_action(client.sock.recv(65536))
        assert got[2] & WATCHDOG and got[3] == pytest.approx([0.1]) and got[0] == 5
        assert time.monotonic() - quiet >= 0.08
        stats = client.stats()
        assert stats["safe_default"] == 2 and stats["malformed"] == 2 and stats["observations"] == 5
        assert stats["watchdog_trips"] >= 1 and stats["watchdog"] is True  # > 1 if this client stalled under load
        # observations again end the watchdog
        assert client.act(7, np.zeros(5))[2] & WATCHDOG == 0
        # past its first FRESH_ACTIONS actions the agent no longer marks them fresh
        assert [client.act(8 + i, np.zeros(5))[2] & FRESH for i in range(FRESH_ACTIONS)][-1] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    final = json.loads(out.strip().splitlines()[-1])
    assert final["observations"] == 6 + FRESH_ACTIONS and final["safe_default"] == 2 and final["act_p99_us"] > 0
    # the loop kept the bundle's rate: every period is a tick or counted as skipped
    periods, expected = final["ticks"] + final["skipped_periods"], final["uptime_s"] / 0.01
    # slack: a loaded host below; above, the first tick at 0 and uptime_s rounded to 1 ms (0.1 of a period)
    assert expected > 10 and 0.75 * expected - 2 <= periods <= expected + 1.1, final


def test_run_loop_over_unix_socket_and_silence_stop(tmp_path):
    root = active_store(tmp_path, period_s=0.005)
    sock_path = tmp_path / "agent.sock"
    proc, address = start(root, "--listen", f"unix://{sock_path}", "--watchdog-periods", "2",
                          "--stop-after-silence", "0.1", "--stats", str(tmp_path / "stats.json"))
    try:
        client = Client(address, tmp_path)
        assert client.act(1, np.full(5, 0.1))[3] == pytest.approx([0.25])
    finally:
        out, err = proc.communicate(timeout=10)  # exits by itself after 0.1 s of silence
    assert proc.returncode == 0, err
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["observations"] == 1 and stats["watchdog_actions"] >= 15
    assert not sock_path.exists()


def test_deadline_misses_are_counted(tmp_path):
    """A 50 µs period cannot be kept by a Python loop: the misses must show in the statistics."""
    root = active_store(tmp_path, period_s=5e-5)
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--duration", "0.5")
    client = Client(address, tmp_path)
    for i in range(200):
        client.sock.sendto(encode_observation(i, 0.0, np.zeros(5, np.float32)), client.peer)
        time.sleep(0.001)
    out, err = proc.communicate(timeout=10)
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["deadline_misses"] > 0 and stats["observations"] > 0


def test_bench_reports_act_against_bare_run(tmp_path):
    root = active_store(tmp_path, period_s=0.02)
    r = run_cli("sim2edge-agent", "bench", "--root", str(root), "--iterations", "3000", "--json")
    assert r.returncode == 0, r.stderr
    b = json.loads(r.stdout)
    assert b["runtime"] == "onnxruntime" and b["iterations"] == 3000
    assert 0 < b["bare_p50_us"] <= b["bare_p99_us"] and 0 < b["act_p50_us"] <= b["act_p99_us"]
    assert b["ratio_p50"] == pytest.approx(b["act_p50_us"] / b["bare_p50_us"], rel=0.01)
    text = run_cli("sim2edge-agent", "bench", "--root", str(root), "--iterations", "500")
    assert "ratio act/bare" in text.stdout


def test_large_finite_observation_is_not_mistaken_for_nan(tmp_path):
    """act()'s fast finiteness test (a dot product) overflows on huge values; the exact test must clear them."""
    from edge.policy import Policy

    policy = Policy.load(active_store(tmp_path, period_s=0.02))
    assert policy.act(np.full(5, 1e20, np.float32)) == pytest.approx([0.8])
    assert policy.act(np.full(5, -3e38, np.float32)) == pytest.approx([-0.5])
    assert policy.unsafe_count == 0
    batch = np.zeros((3, 5), np.float32)
    batch[1, 0] = np.inf
    assert policy.act(batch)[:, 0] == pytest.approx([0.0, 0.1, 0.0]) and policy.unsafe_count == 1


def test_joint_state_tail_is_recorded_and_a_changed_size_is_malformed(tmp_path):
    from edge import telemetry

    root = active_store(tmp_path, period_s=0.005)
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--telemetry", "--watchdog-periods", "100000")
    client = Client(address, tmp_path)
    client.sock.sendto(encode_observation(1, 0.0, np.zeros(5), np.array([1, 2, 3, 4])), client.peer)
    assert decode_action(client.sock.recv(65536))[0] == 1
    assert client.act(2, np.zeros(5))[0] == 2  # no tail: accepted, state recorded as NaN
    client.sock.sendto(encode_observation(3, 0.0, np.zeros(5), np.array([1, 2, 3])), client.peer)  # size changed
    client.sock.sendto(encode_observation(4, 0.0, np.zeros(5), np.array([1, 2, 3, 4]))[:-2], client.peer)  # torn
    assert client.act(5, np.zeros(5))[0] == 5 and client.stats()["malformed"] == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)
    (f,) = (root / "telemetry" / "pending").glob("*.npz")
    cols = telemetry.read(f)
    assert sorted(k for k in cols if k.startswith("state.")) == ["state.0", "state.1", "state.2", "state.3"]
    assert list(cols["state.3"][:1]) == [4.0] and np.isnan(cols["state.0"][1:]).all() and len(cols["step"]) == 3


def test_single_observation_fast_path_matches_the_batch_path(tmp_path):
    """act() on one observation runs through IO-bound buffers; its answers must be the batch path's, and
    must not be overwritten by the next call."""
    from edge.policy import Policy

    policy = Policy.load(active_store(tmp_path, period_s=0.02))
    assert policy.io_bound, "the CPU provider should take the IO-binding path"
    xs = np.random.default_rng(1).normal(scale=0.5, size=(50, 5)).astype(np.float32)
    xs[7, 2] = np.nan
    singles = [policy.act(x) for x in xs]
    assert policy.unsafe_count == 1
    np.testing.assert_allclose(np.stack(singles), policy.act(xs), atol=1e-6)
    assert singles[7] == pytest.approx([0.1]) and policy.act([0.1] * 5) == pytest.approx([0.25])
