"""The evaluation host's end of a ROS 2 link: the twin as the robot ``sim2edge-agent ros2`` controls.

``--hil ros2://`` (the agent's default topics) or ``ros2://?state=/joint_states&command=/sim2edge/command&action=
/sim2edge/action``. Each observation goes out as the ``sensor_msgs/msg/JointState`` a robot would publish: the
task's contract read backwards (``edge.ros2.ObservationMap``: a ``<joint>_pos`` term is that joint's position minus
its offset), its command terms on the command topic when they change. The header stamp carries the observation's
sequence number (``sec``); the agent echoes it exactly in the ``trajectory_msgs/msg/JointTrajectory`` it answers
with (``--action-type joint_trajectory``; a ``Float64MultiArray`` answer cannot be paired with its observation).

Over ROS 2 there is no statistics request: the device's counters, runtime and graph are not known to the host, and
a restart shows only as silence. Fast DDS discovery takes about a second, so the link waits until the agent's
subscription and publication are matched before the first probe.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional
from urllib.parse import parse_qs, urlsplit

import numpy as np

from stages.io_spec import IOSpec
from stages.sim.task import Task
from stages.twin.hil_link import Arrival, DeviceFailed

DEFAULT_TOPICS = {"state": "/joint_states", "command": "/sim2edge/command", "action": "/sim2edge/action"}


def parse_topics(address: str) -> dict[str, str]:
    """``ros2://[?state=…&command=…&action=…]`` → the three topics; ValueError in one line for anything else."""
    parts = urlsplit(address)
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(DEFAULT_TOPICS))
    if parts.scheme != "ros2" or parts.netloc or parts.path or unknown:
        raise ValueError(f"device address {address!r} must be ros2:// with optional state=, command=, action= topics")
    topics = {**DEFAULT_TOPICS, **{k: v[-1] for k, v in query.items()}}
    bad = [t for t in topics.values() if not t.startswith("/")]
    if bad:
        raise ValueError(f"device address {address!r}: topic {bad[0]!r} must start with /")
    return topics


class RosLink:
    """A ROS 2 node of its own (its own context, executor thread) speaking JointState out, JointTrajectory in."""

    restart: Optional[Arrival] = None  # a restart cannot be told over ROS 2, only its silence

    def __init__(self, address: str, task: Task, discovery_s: float = 10.0) -> None:
        from edge.ros2 import CONTROL_QOS, COMMAND_QOS, ObservationMap

        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray
        from trajectory_msgs.msg import JointTrajectory

        self.address, topics = address, parse_topics(address)
        self.map = ObservationMap.from_manifest({"io": IOSpec.from_task(task).manifest_io("obs", "act")})
        self._JointState, self._Float64MultiArray = JointState, Float64MultiArray
        self._sent: dict[int, float] = {}
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._command: Optional[np.ndarray] = None
        self._rclpy, self._context = rclpy, rclpy.Context()
        rclpy.init(context=self._context)
        self.node = rclpy.create_node("sim2edge_hil", context=self._context)
        self.state = self.node.create_publisher(JointState, topics["state"], CONTROL_QOS)
        self.commands = self.node.create_publisher(Float64MultiArray, topics["command"], COMMAND_QOS)
        self.actions = self.node.create_subscription(JointTrajectory, topics["action"], self._on_action, CONTROL_QOS)
        self.executor = SingleThreadedExecutor(context=self._context)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self.executor.spin, name="sim2edge-hil-ros2", daemon=True)
        self._spinner.start()
        self._wait_for_agent(topics, discovery_s)

    def _wait_for_agent(self, topics: dict[str, str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.state.get_subscription_count() == 0 or self.actions.get_publisher_count() == 0:
            if time.monotonic() > deadline:
                self.close()
                raise DeviceFailed(f"{self.address}: no agent subscribes to {topics['state']} and publishes on "
                                   f"{topics['action']} (sim2edge-agent ros2 --action-type joint_trajectory) within "
                                   f"{timeout_s:g} s")
            time.sleep(0.05)

    def _on_action(self, msg) -> None:
        at = time.monotonic()
        seq = int(msg.header.stamp.sec)
        if seq in self._sent and msg.points:
            self._arrivals.put(Arrival(seq, self._sent[seq], 0, np.asarray(msg.points[0].positions, np.float32), at))

    def send_observation(self, seq: int, values: np.ndarray, state: Optional[np.ndarray] = None) -> float:
        """Publish ``values`` (the task's observation) as the robot's JointState stamped ``seq``, and its command
        terms when they changed; returns the host's send time."""
        names = self.map.joint_names
        msg = self._JointState(name=list(names))
        fields = {"position": np.zeros(len(names)), "velocity": np.zeros(len(names))}
        for i, joint, field, offset in self.map.joints:
            fields[field][names.index(joint)] = float(values[i]) + offset
        msg.position, msg.velocity = fields["position"].tolist(), fields["velocity"].tolist()
        msg.header.stamp.sec = seq
        command = np.asarray(values)[list(self.map.commands)]
        if self.map.commands and (self._command is None or not np.array_equal(command, self._command)):
            self.commands.publish(self._Float64MultiArray(data=command.astype(float).tolist()))
            self._command = command
        stamp = self._sent[seq] = time.monotonic()
        self.state.publish(msg)
        return stamp

    def receive(self, until: float, awaited: Optional[int] = None) -> list[Arrival]:
        """Every action arriving before the host clock reaches ``until``, or up to the one answering ``awaited``."""
        got: list[Arrival] = []
        while not (got and got[-1].seq == awaited):
            try:
                got.append(self._arrivals.get(timeout=max(0.0, until - time.monotonic())))
            except queue.Empty:
                return got
        return got

    def stats(self, timeout_s: float = 1.0, tries: int = 3) -> Optional[dict]:
        return None  # no statistics request over ROS 2

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self._rclpy.shutdown(context=self._context)
