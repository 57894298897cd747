"""``sim2edge-agent ros2``: the control loop of ``run`` as a ROS 2 node.

Observation: ``sensor_msgs/msg/JointState`` on the state topic, matched by joint name to the bundle's
I/O contract (``io.input.terms``): a term ``<joint>_pos`` is that joint's position, ``<joint>_vel`` its
velocity, each minus the term's ``offset`` when the contract sets one. Terms with ``source: command``
come from the latest ``std_msgs/msg/Float64MultiArray`` on the command topic, in the contract's order
(NaN until one arrives, so the policy answers with the safe default). A contract term that is neither
is refused at start. Each JointState is one observation; a message lacking a needed joint, or a
command of the wrong length, is dropped and counted as malformed.

Action: ``Float64MultiArray`` (the contract's action order) or ``trajectory_msgs/msg/JointTrajectory``
(joint names = action names, one point at ``time_from_start`` = one period, header stamp = the
answered observation's stamp, exactly), one per period with a new observation, by the same clock-anchored
loop as ``run`` (edge/control.py): NaN/Inf guard, watchdog (the safe default every period after K silent
ones), deadline accounting and statistics are ControlLoop's.

Telemetry (``--telemetry``) and statistics reports (``--registry``) as ``run`` has them; each row's joint
state (``state.<i>``) is the positions, then the velocities, of the joints the contract reads, in the order
it first names them, as the JointState carried them (before offsets).

QoS: state and action topics best effort, keep last 1 (a late sample is worth nothing to a controller;
a best-effort publisher is not seen by a reliable subscriber). Commands: reliable, keep last 1.
rclpy is imported here only; the rest of the agent runs without ROS.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from edge.control import ControlLoop, Observation, ReportTo, recorder_for, report_periodically
from edge.policy import Policy
from edge.telemetry import Recorder

PACKAGES = ("ros-jazzy-rclpy ros-jazzy-sensor-msgs ros-jazzy-std-msgs ros-jazzy-trajectory-msgs "
            "ros-jazzy-rmw-fastrtps-cpp")
ACTION_TYPES = ("float64_array", "joint_trajectory")

os.environ.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")  # the only RMW on PyPI
try:
    import rclpy
    from builtin_interfaces.msg import Time
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from rclpy.signals import SignalHandlerOptions
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint
except ImportError as e:
    raise ImportError(f"ROS 2 is not installed ({e}); pip install {PACKAGES}") from None

CONTROL_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
COMMAND_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE)


@dataclass(frozen=True)
class ObservationMap:
    """Where each contract term comes from: (term index, joint, "position"/"velocity", offset) and command indices."""

    joints: Tuple[Tuple[int, str, str, float], ...]
    commands: Tuple[int, ...]
    size: int

    @classmethod
    def from_manifest(cls, manifest: dict) -> "ObservationMap":
        joints, commands, unmapped = [], [], []
        for i, term in enumerate(manifest["io"]["input"]["terms"]):
            name = term["name"]
            if term.get("source") == "command":
                commands.append(i)
            elif name.endswith(("_pos", "_vel")):
                field = "position" if name.endswith("_pos") else "velocity"
                joints.append((i, name[:-4], field, float(term.get("offset") or 0.0)))
            else:
                unmapped.append(name)
        if unmapped:
            raise ValueError(f"observation terms {', '.join(unmapped)} are neither <joint>_pos, <joint>_vel nor "
                             f"source: command; a JointState cannot provide them")
        return cls(tuple(joints), tuple(commands), len(manifest["io"]["input"]["terms"]))

    @property
    def joint_names(self) -> Tuple[str, ...]:
        """The joints the contract reads, in the order it first names them."""
        return tuple(dict.fromkeys(joint for _, joint, _, _ in self.joints))

    def joint_state(self, msg: "JointState") -> Optional[np.ndarray]:
        """For telemetry: the positions, then the velocities, of :attr:`joint_names` as the robot measured them
        (NaN where the message lacks one)."""
        index = {n: k for k, n in enumerate(msg.name)}
        out = np.full(2 * len(self.joint_names), np.nan, np.float32)
        for j, joint in enumerate(self.joint_names):
            k = index.get(joint)
            for f, field in enumerate(("position", "velocity")):
                values = getattr(msg, field)
                if k is not None and k < len(values):
                    out[f * len(self.joint_names) + j] = values[k]
        return out

    def observation(self, msg: "JointState", command: np.ndarray) -> Optional[np.ndarray]:
        """The policy's input from a JointState and the latest command; None if a needed joint is missing."""
        index = {n: k for k, n in enumerate(msg.name)}
        obs = np.empty(self.size, np.float32)
        for i, joint, field, offset in self.joints:
            values, k = getattr(msg, field), index.get(joint)
            if k is None or k >= len(values):
                return None
            obs[i] = values[k] - offset
        obs[list(self.commands)] = command
        return obs


class RosLoop(ControlLoop):
    """ControlLoop whose observations are JointState messages and whose actions are ROS 2 messages."""

    def __init__(self, policy: Policy, node: "rclpy.node.Node", topics: Tuple[str, str, str], action_type: str,
                 watchdog_periods: int, stats_window: int = 10000, recorder: Optional[Recorder] = None) -> None:
        super().__init__(policy, None, watchdog_periods, recorder=recorder, stats_window=stats_window)
        self.map = ObservationMap.from_manifest(policy.manifest)
        self.command = np.full(len(self.map.commands), np.nan, np.float32)
        self.action_type = action_type
        self._pending: Optional[JointState] = None
        self._stamp = Time()  # the header stamp of the observation answered last, echoed exactly
        self._lock = threading.Lock()
        self._received = 0
        state, command, action = topics
        node.create_subscription(JointState, state, self._on_state, CONTROL_QOS)
        if self.map.commands:
            node.create_subscription(Float64MultiArray, command, self._on_command, COMMAND_QOS)
        kind = JointTrajectory if action_type == "joint_trajectory" else Float64MultiArray
        self.publisher = node.create_publisher(kind, action, CONTROL_QOS)

    def _on_state(self, msg: "JointState") -> None:
        with self._lock:
            if self._pending is not None:
                self.counts["dropped_stale"] += 1  # two observations in one period: the older is skipped
            self._pending = msg

    def _on_command(self, msg: "Float64MultiArray") -> None:
        if len(msg.data) != len(self.map.commands):
            with self._lock:
                self.counts["malformed"] += 1
            return
        self.command = np.asarray(msg.data, np.float32)

    def _receive(self) -> Optional[Observation]:
        with self._lock:
            msg, self._pending = self._pending, None
        if msg is None:
            return None
        obs = self.map.observation(msg, self.command)
        if obs is None:
            with self._lock:
                self.counts["malformed"] += 1
            return None
        self._received += 1
        self._stamp = msg.header.stamp
        return self._received, self._stamp.sec + self._stamp.nanosec * 1e-9, obs, self.map.joint_state(msg)

    def _send(self, seq: int, stamp: float, flags: int, action: np.ndarray) -> None:
        values: List[float] = action.astype(float).tolist()
        if self.action_type == "joint_trajectory":
            msg = JointTrajectory(joint_names=list(self.policy.action_names))
            msg.header.stamp = self._stamp
            point = JointTrajectoryPoint(positions=values)
            point.time_from_start.nanosec = int(self.period * 1e9)
            msg.points = [point]
        else:
            msg = Float64MultiArray(data=values)
        self.publisher.publish(msg)
        self.counts["actions"] += 1


def serve(root: Path, state_topic: str, command_topic: str, action_topic: str, action_type: str = "float64_array",
          watchdog_periods: int = 5, duration_s: Optional[float] = None, stats_path: Optional[Path] = None,
          stats_window: int = 10000, telemetry: Optional[dict] = None, report: Optional[ReportTo] = None) -> dict:
    """Serve the active policy of the store at ``root`` as the ROS 2 node ``sim2edge_agent`` (the CLI's ``ros2``);
    ``telemetry`` and ``report`` as for ``run`` (edge/control.py)."""
    if action_type not in ACTION_TYPES:
        raise ValueError(f"action type {action_type!r}: one of {', '.join(ACTION_TYPES)}")
    policy = Policy.load(root)
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)  # SIGTERM/SIGINT stop the loop, as in ``run``
    try:
        node = rclpy.create_node("sim2edge_agent")
        if telemetry is not None:  # MCAP's JointState carries the ROS joint names
            telemetry = dict(telemetry, joint_names=list(ObservationMap.from_manifest(policy.manifest).joint_names))
        loop = RosLoop(policy, node, (state_topic, command_topic, action_topic), action_type, watchdog_periods,
                       stats_window, recorder_for(root, policy, telemetry))
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        spinner = threading.Thread(target=executor.spin, name="sim2edge-ros2", daemon=True)
        spinner.start()
        signal.signal(signal.SIGTERM, loop.stop)
        signal.signal(signal.SIGINT, loop.stop)
        m = policy.manifest["policy"]
        print(f"serving {m['name']} v{m['version']} on ROS 2 {state_topic} -> {action_topic} ({action_type}) every "
              f"{policy.period_s * 1e3:g} ms ({policy.runtime.name}, watchdog after {watchdog_periods} periods)",
              flush=True)
        reporting = report_periodically(loop, root, report) if report is not None else None
        stats = loop.serve(duration_s)
        loop.stop()
        if reporting is not None:
            reporting.join(report.timeout_s + 1.0)  # the final report, one short attempt
        executor.shutdown()
        spinner.join()
        node.destroy_node()
    finally:
        rclpy.try_shutdown()
    if stats_path is not None:
        stats_path.write_text(json.dumps(stats, sort_keys=True))
    return stats
