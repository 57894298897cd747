"""Observation → action latency through ``sim2edge-agent ros2`` (Fast DDS on loopback) vs ``run`` (UDP), same run.

One request at a time, each after a random pause (uniform over a period, so requests do not lock onto the
loop's ticks): the client sends an observation stamped with its monotonic clock and waits for the action
echoing that stamp. Both agents serve the same tiny bundle (tests/test_agent_ros2.py's contract) at the
same control period, so both latencies include the wait for the next tick (half a period on average);
the difference of the two is the transport's.

Run: PYTHONPATH=. .venv/bin/python benchmarks/ros2_latency.py [--samples N] [--period S]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge.control import decode_action, encode_observation  # noqa: E402
from tests.test_agent_ros2 import AGENT, GOAL, ros_env, ros_store  # noqa: E402

OBS = np.array([0.4, 0.2, 0.1, 0.0, GOAL], np.float32)  # j1 0.5 rad (offset 0.1), 0.2 rad/s; j2 0.1 rad; the goal


def start(root: Path, env: dict, *args: str) -> Tuple[subprocess.Popen, str]:
    """An agent command on the store at ``root``; returns the process and its "serving" line."""
    proc = subprocess.Popen([AGENT, *args, "--root", str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("serving"), line + proc.stderr.read()
    return proc, line


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def pause(period_s: float, rng: np.random.Generator) -> None:
    time.sleep(rng.uniform(0.0, period_s))


def udp_latencies(root: Path, n: int, period_s: float) -> List[float]:
    proc, line = start(root, dict(os.environ), "run", "--listen", "udp://127.0.0.1:0", "--watchdog-periods", "1000000")
    host, _, port = line.split(" on udp://", 1)[1].split(" ")[0].rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    out, rng = [], np.random.default_rng(0)
    try:
        for seq in range(n):
            pause(period_s, rng)
            sent = time.monotonic()
            sock.sendto(encode_observation(seq, sent, OBS), (host, int(port)))
            while decode_action(sock.recv(65536))[0] != seq:
                pass
            out.append(time.monotonic() - sent)
    finally:
        stop(proc)
    return out


def ros2_latencies(root: Path, n: int, period_s: float, env: dict) -> List[float]:
    os.environ.update(env)  # before rclpy loads: the same RMW, profile and domain as the agent
    import rclpy
    from rclpy.signals import SignalHandlerOptions
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray
    from trajectory_msgs.msg import JointTrajectory

    from edge.ros2 import COMMAND_QOS, CONTROL_QOS

    proc, _ = start(root, env, "ros2", "--action-type", "joint_trajectory", "--watchdog-periods", "1000000")
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node("latency_client")
    state = node.create_publisher(JointState, "/joint_states", CONTROL_QOS)
    command = node.create_publisher(Float64MultiArray, "/sim2edge/command", COMMAND_QOS)
    got = {}
    node.create_subscription(JointTrajectory, "/sim2edge/action", lambda m: got.setdefault(
        (m.header.stamp.sec, m.header.stamp.nanosec), (time.monotonic(), m.points[0].positions[0])), CONTROL_QOS)

    def ask(timeout_s: float = 1.0) -> Tuple[float, float]:
        """(latency, action) for one JointState; (inf, nan) if no answer."""
        sent = time.monotonic()
        msg = JointState(name=["j1", "j2"], position=[0.5, 0.1], velocity=[0.2, 0.0])
        key = (int(sent), int((sent % 1.0) * 1e9))
        msg.header.stamp.sec, msg.header.stamp.nanosec = key
        state.publish(msg)
        while key not in got and time.monotonic() - sent < timeout_s:
            rclpy.spin_once(node, timeout_sec=0.001)
        return (got[key][0] - sent, got[key][1]) if key in got else (float("inf"), float("nan"))

    out, rng = [], np.random.default_rng(0)
    try:
        while state.get_subscription_count() == 0 or command.get_subscription_count() == 0:
            rclpy.spin_once(node, timeout_sec=0.05)
        command.publish(Float64MultiArray(data=[GOAL]))
        while not ask()[1] > 0.4:  # warm-up: until the command is in (the action is 0.45, not the default)
            pass
        for _ in range(n):
            pause(period_s, rng)
            out.append(ask()[0])
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
        stop(proc)
    return out


def pct(xs: List[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--period", type=float, default=0.002, help="the bundle's control period (default %(default)s)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    with pytest.MonkeyPatch.context() as patch:
        root = ros_store(tmp, patch, a.period)
    udp = udp_latencies(root, a.samples, a.period)
    ros = ros2_latencies(root, a.samples, a.period, ros_env(tmp))
    lost = sum(x == float("inf") for x in ros)
    ros = [x for x in ros if x != float("inf")]
    print(f"observation -> action, {a.samples} requests one at a time, control period {a.period * 1e3:g} ms")
    print(f"  run  (UDP)          p50 {pct(udp, 50):7.3f} ms  p99 {pct(udp, 99):7.3f} ms")
    print(f"  ros2 (Fast DDS)     p50 {pct(ros, 50):7.3f} ms  p99 {pct(ros, 99):7.3f} ms  ({lost} unanswered)")
    print(f"  ratio ros2/udp      p50 {pct(ros, 50) / pct(udp, 50):.2f}x     p99 {pct(ros, 99) / pct(udp, 99):.2f}x")
    print(f"  ros2 - udp          p50 {pct(ros, 50) - pct(udp, 50):+7.3f} ms  p99 {pct(ros, 99) - pct(udp, 99):+7.3f} ms")


if __name__ == "__main__":
    main()
