"""``sim2edge-agent ros2`` closing the loop with a stand-in robot node over real DDS on loopback.

Three processes of this venv: the agent, a stand-in robot (``python -m tests.test_agent_ros2 robot``: a
deterministic plant publishing JointState, pairing each action with its observation by the echoed stamp)
and a listener recording every action (``... listen``). Fast DDS is confined to 127.0.0.1 by an XML profile.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import bundles

pytestmark = pytest.mark.ros2
AGENT = str(Path(sys.executable).parent / "sim2edge-agent")
PERIOD, GOAL, OFFSET = 0.02, 0.2, 0.1
ROS_IO = {"input": {"terms": [{"name": "j1_pos", "unit": "rad", "offset": OFFSET}, {"name": "j1_vel", "unit": "rad/s"},
                              {"name": "j2_pos", "unit": "rad"}, {"name": "j2_vel", "unit": "rad/s"},
                              {"name": "goal", "unit": "rad", "source": "command"}]},
          "output": bundles.TINY_IO["output"]}
"""The tiny graph (0.5 × sum, limits [-0.5, 0.8], default 0.1) on two joints and one command term."""

PROFILE = """<?xml version="1.0" encoding="UTF-8" ?>
<profiles xmlns="http://www.eprosima.com/XMLSchemas/fastRTPS_Profiles">
  <transport_descriptors><transport_descriptor>
    <transport_id>loopback</transport_id><type>UDPv4</type>
    <interfaceWhiteList><address>127.0.0.1</address></interfaceWhiteList>
  </transport_descriptor></transport_descriptors>
  <participant profile_name="loopback" is_default_profile="true"><rtps>
    <userTransports><transport_id>loopback</transport_id></userTransports>
    <useBuiltinTransports>false</useBuiltinTransports>
    <builtin>
      <metatrafficUnicastLocatorList><locator><udpv4><address>127.0.0.1</address></udpv4></locator>
      </metatrafficUnicastLocatorList>
      <initialPeersList><locator><udpv4><address>127.0.0.1</address></udpv4></locator></initialPeersList>
    </builtin>
  </rtps></participant>
</profiles>
"""


def ros_env(tmp: Path) -> dict:
    """Fast DDS on loopback only, logs under ``tmp``, a domain of this test run's own."""
    (tmp / "fastdds.xml").write_text(PROFILE)
    return {**os.environ, "RMW_IMPLEMENTATION": "rmw_fastrtps_cpp", "FASTRTPS_DEFAULT_PROFILES_FILE":
            str(tmp / "fastdds.xml"), "ROS_HOME": str(tmp / "ros"), "ROS_LOG_DIR": str(tmp / "ros" / "log"),
            "ROS_DOMAIN_ID": str(1 + os.getpid() % 100), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}


@pytest.fixture
def ros(tmp_path, monkeypatch):
    monkeypatch.setenv("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")  # rclpy fails at import without an RMW named
    pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (pip install '.[ros2]')")
    return ros_env(tmp_path)


def ros_store(tmp_path: Path, monkeypatch, period_s: float = PERIOD) -> Path:
    """The tiny bundle with the ROS contract (``ROS_IO``: offsets and a command term kept), written by the
    real packager and active in a device store."""
    from stages.io_spec import ObservationTerm

    plain = bundles.io_spec
    monkeypatch.setattr(bundles, "io_spec", lambda io, period_s, task="cartpole": plain(io, period_s, task).model_copy(
        update={"observations": tuple(ObservationTerm(**t) for t in io["input"]["terms"])}))
    return bundles.active_store(tmp_path, period_s=period_s, io=ROS_IO)


def run_steady(root: Path, env: dict, tmp_path: Path, *agent_args: str) -> None:
    """The agent (``agent_args``) against the ``steady`` robot node until the robot is done (what it heard in
    ``tmp_path/steady.json``), then stopped."""
    agent = start_agent(root, env, *agent_args)
    robot = helper("steady", env, "--out", str(tmp_path / "steady.json"))
    try:
        line = robot.stdout.readline()
        assert line.startswith("done"), line + robot.stderr.read()
    finally:
        robot.wait(timeout=20)
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)


def start_agent(root: Path, env: dict, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([AGENT, "ros2", "--root", str(root), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    assert line.startswith("serving tiny v1 on ROS 2 "), line + proc.stderr.read()
    return proc


def helper(mode: str, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.test_agent_ros2", mode, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parent.parent)


def observation(position: list, velocity: list, goal: float) -> np.ndarray:
    """The contract's observation from what the robot sent (j1, j2 positions and velocities, the goal)."""
    return np.array([position[0] - OFFSET, velocity[0], position[1], velocity[1], goal], np.float32)


def test_ros2_node_closes_the_loop_guards_and_watches(tmp_path, ros, monkeypatch):
    from edge.policy import Policy

    root = ros_store(tmp_path, monkeypatch)
    stats_path, record, heard = tmp_path / "stats.json", tmp_path / "robot.json", tmp_path / "heard.json"
    agent = start_agent(root, ros, "--action-type", "joint_trajectory", "--watchdog-periods", "5",
                        "--stats", str(stats_path))
    listener = helper("listen", ros, "--out", str(heard))
    robot = None
    try:
        assert listener.stdout.readline().startswith("hearing"), listener.stderr.read()
        robot = helper("robot", ros, "--out", str(record), "--steps", "40")
        line = robot.stdout.readline()
        assert line.startswith("done"), line + robot.stderr.read()
        time.sleep(0.3)  # the robot holds a steady observation
        robot.send_signal(signal.SIGKILL)
        killed = time.time()
        time.sleep(1.0)
    finally:
        for proc in (robot, listener, agent):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)
        out, err = agent.communicate()
    assert agent.returncode == 0, err
    policy = Policy.load(root)
    got = json.loads(record.read_text())
    assert len(got["pairs"]) >= 30, got  # best effort: a loaded host may lose a few; the robot re-sends
    for position, velocity, action in got["pairs"]:
        assert action == pytest.approx(policy.act(observation(position, velocity, GOAL)).tolist(), abs=1e-6)
    assert len({round(a[0], 6) for _, _, a in got["pairs"]}) > 5  # the plant moved: actions changed
    assert got["nan_action"] == pytest.approx([0.1])  # the guard: a NaN joint position gets the safe default
    actions = json.loads(heard.read_text())
    after = [a for t, a in actions if t > killed + 0.5]  # 5 periods, and slack for a loaded host
    assert len(after) >= 5 and all(a == pytest.approx([0.1]) for a in after), after  # the watchdog's default
    assert any(a != pytest.approx([0.1]) for t, a in actions if t < killed)
    stats = json.loads(stats_path.read_text())
    assert stats == json.loads(out.strip().splitlines()[-1])
    assert stats["safe_default"] == got["warmup_defaults"] + got["nan_sent"] and stats["malformed"] == 1 and stats["watchdog_trips"] >= 2, stats
    assert stats["observations"] >= len(got["pairs"]) and stats["watchdog_actions"] >= len(after)


def test_ros2_float64_array_actions_answer_the_robots_state(tmp_path, ros, monkeypatch):
    """The default action type: a plain ``Float64MultiArray`` (no stamp, no names), as a ros2_control
    forward command controller takes it; a robot holding two states gets each state's action, and telemetry
    records what it saw: the observations and the joint state (positions, then velocities of j1, j2)."""
    from edge import telemetry
    from edge.policy import Policy

    root = ros_store(tmp_path, monkeypatch)
    run_steady(root, ros, tmp_path, "--telemetry", "--device-id", "arm-3")
    policy = Policy.load(root)
    heard = json.loads((tmp_path / "steady.json").read_text())
    for name, (position, velocity) in STEADY.items():
        expected = policy.act(observation(position, velocity, GOAL)).tolist()
        assert heard[name] and heard[name][-1] == pytest.approx(expected, abs=1e-6), (name, heard[name][-5:])
    assert heard["a"][-1] != pytest.approx(heard["b"][-1])  # the two states ask for different actions
    files = sorted((root / "telemetry" / "pending").glob("*.npz"))
    cols = [telemetry.read(f) for f in files]
    state = np.concatenate([np.stack([c[f"state.{j}"] for j in range(4)], axis=1) for c in cols])
    sent = {tuple(np.float32(position + velocity)) for position, velocity in STEADY.values()}
    assert {tuple(row) for row in state} == sent, state[:3]
    obs = np.concatenate([c["obs.j1_pos"] for c in cols])
    assert set(np.round(obs, 5)) == {np.float32(p[0] - OFFSET).round(5) for p, _ in STEADY.values()}
    assert {str(d) for c in cols for d in c["device_id"]} == {"arm-3"}


def test_ros2_mcap_telemetry_names_the_ros_joints(tmp_path, ros, monkeypatch):
    """``--telemetry-format mcap`` under ``ros2``: the recorded JointState carries the contract's ROS joint names."""
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    root = ros_store(tmp_path, monkeypatch)
    run_steady(root, ros, tmp_path, "--telemetry", "--telemetry-format", "mcap")
    rows = set()
    for f in sorted((root / "telemetry" / "pending").glob("*.mcap")):
        with open(f, "rb") as stream:
            for _, channel, _, msg in make_reader(stream, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
                    topics=["/sim2edge/joint_states"]):
                assert list(msg.name) == ["j1", "j2"]
                rows.add(tuple(np.float32([*msg.position, *msg.velocity])))
    assert rows == {tuple(np.float32(position + velocity)) for position, velocity in STEADY.values()}

def test_ros2_refuses_a_contract_joint_state_cannot_fill(tmp_path, ros):
    root = bundles.active_store(tmp_path, period_s=PERIOD)  # terms a..e: neither joints nor commands
    r = subprocess.run([AGENT, "ros2", "--root", str(root), "--duration", "1"], capture_output=True, text=True,
                       env=ros, timeout=60)
    assert r.returncode == 2 and "observation terms a, b, c, d, e are neither" in r.stderr, r.stderr


def test_missing_rclpy_is_one_line_naming_the_packages(tmp_path):
    """Without the ROS 2 wheels (rclpy hidden), ``ros2`` says what to install and exits 2; ``run`` is unaffected."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "rclpy.py").write_text("raise ImportError('No module named rclpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([AGENT, "ros2", "--root", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install ros-jazzy-rclpy ros-jazzy-sensor-msgs" in r.stderr


# ---- the stand-in robot and the listener (run as ``python -m tests.test_agent_ros2 robot|listen``) ----

def _node(name: str):
    import rclpy
    from rclpy.signals import SignalHandlerOptions

    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    return rclpy.create_node(name)


def _stamp(msg) -> float:
    return msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9


def robot(out: Path, steps: int) -> None:
    """A plant of two joints (j1 driven: velocity = action; j2 oscillating), one JointState per action received;
    then a JointState missing j2, one with a NaN position, and a steady state until killed."""
    import rclpy
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray
    from trajectory_msgs.msg import JointTrajectory

    from edge.ros2 import COMMAND_QOS, CONTROL_QOS

    node = _node("standin_robot")
    state = node.create_publisher(JointState, "/joint_states", CONTROL_QOS)
    command = node.create_publisher(Float64MultiArray, "/sim2edge/command", COMMAND_QOS)
    answers = {}  # stamp → the first action echoing it (the watchdog's later ones echo it too)
    node.create_subscription(JointTrajectory, "/sim2edge/action",
                             lambda m: answers.setdefault(round(_stamp(m), 6), list(m.points[0].positions)), CONTROL_QOS)
    while state.get_subscription_count() == 0 or command.get_subscription_count() == 0 \
            or node.count_publishers("/sim2edge/action") == 0:
        rclpy.spin_once(node, timeout_sec=0.05)
    command.publish(Float64MultiArray(data=[GOAL]))
    stamp = [1000]

    def ask(names: list, position: list, velocity: list, wait_s: float = 0.5, tries: int = 5):
        """Publish a JointState (re-sent if no answer comes) and return the action answering it."""
        for _ in range(tries):
            stamp[0] += 1
            msg = JointState(name=names, position=position, velocity=velocity)
            msg.header.stamp.sec = stamp[0]
            state.publish(msg)
            end = time.monotonic() + wait_s
            while time.monotonic() < end and float(stamp[0]) not in answers:
                rclpy.spin_once(node, timeout_sec=0.01)
            if float(stamp[0]) in answers:
                return answers[float(stamp[0])]
        return None

    # until the agent has the command (a reliable sample may wait for the next heartbeat) it answers with
    # the safe default (0.1); this steady state's action is 0.45
    first = stamp[0] + 1
    while not (ask(["j1", "j2"], [0.5, 0.1], [0.2, 0.0], wait_s=0.1) or [0.1])[0] > 0.4:
        pass
    end = time.monotonic() + 0.3  # late answers of the warm-up
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.01)
    warmup = sum(abs(answers.get(float(s), [0.45])[0] - 0.1) < 1e-6 for s in range(first, stamp[0] + 1))
    q, v, pairs = [0.0, 0.0], [0.0, 0.0], []
    for k in range(steps):
        v[1] = float(np.cos(k * 0.3))
        q[1] += v[1] * PERIOD
        # names in another order than the contract's, with a joint the policy does not use
        got = ask(["j2", "gripper", "j1"], [q[1], 5.0, q[0]], [v[1], 0.0, v[0]])
        if got is not None:
            pairs.append(([q[0], q[1]], [v[0], v[1]], got))
            v[0] = got[0]
            q[0] += v[0] * PERIOD
    ask(["j1"], [q[0]], [v[0]], wait_s=0.1, tries=1)  # malformed (no j2): never answered
    before = stamp[0]
    nan = ask(["j1", "j2"], [float("nan"), q[1]], [v[0], v[1]])
    out.write_text(json.dumps({"pairs": pairs, "nan_action": nan, "nan_sent": stamp[0] - before,
                                "warmup_defaults": warmup}))
    print("done", flush=True)
    while True:
        ask(["j1", "j2"], [0.5, 0.1], [0.2, 0.0], wait_s=0.05)


STEADY = {"a": ([0.5, 0.1], [0.2, 0.0]), "b": ([-0.3, 0.2], [0.1, 0.4])}
"""Two states the steady robot holds in turn, each until its action settles."""


def steady(out: Path, hold_s: float = 1.0) -> None:
    """Hold each of ``STEADY`` for ``hold_s`` at the control rate, recording the Float64MultiArray actions heard
    meanwhile; print "done"."""
    import rclpy
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    from edge.ros2 import COMMAND_QOS, CONTROL_QOS

    node = _node("steady_robot")
    state = node.create_publisher(JointState, "/joint_states", CONTROL_QOS)
    command = node.create_publisher(Float64MultiArray, "/sim2edge/command", COMMAND_QOS)
    heard, now = {name: [] for name in STEADY}, [None]
    node.create_subscription(Float64MultiArray, "/sim2edge/action",
                             lambda m: now[0] is not None and heard[now[0]].append(list(m.data)), CONTROL_QOS)
    while state.get_subscription_count() == 0 or node.count_publishers("/sim2edge/action") == 0:
        rclpy.spin_once(node, timeout_sec=0.05)
    for name, (position, velocity) in STEADY.items():
        now[0], end = name, time.monotonic() + hold_s
        while time.monotonic() < end:
            command.publish(Float64MultiArray(data=[GOAL]))
            state.publish(JointState(name=["j1", "j2"], position=position, velocity=velocity))
            until = time.monotonic() + PERIOD
            while time.monotonic() < until:
                rclpy.spin_once(node, timeout_sec=0.005)
    out.write_text(json.dumps(heard))
    print("done", flush=True)


def listen(out: Path) -> None:
    """Record (wall time, action) for every action until SIGTERM; print "hearing" at the first."""
    import rclpy
    from trajectory_msgs.msg import JointTrajectory

    from edge.ros2 import CONTROL_QOS

    node, heard, stop = _node("listener"), [], []
    node.create_subscription(JointTrajectory, "/sim2edge/action",
                             lambda m: heard.append((time.time(), list(m.points[0].positions))), CONTROL_QOS)
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    announced = False
    while not stop:
        rclpy.spin_once(node, timeout_sec=0.05)
        if heard and not announced:
            print("hearing", flush=True)
            announced = True
    out.write_text(json.dumps(heard))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("robot", "listen", "steady"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    if a.mode == "robot":
        robot(a.out, a.steps)
    elif a.mode == "steady":
        steady(a.out)
    else:
        listen(a.out)
