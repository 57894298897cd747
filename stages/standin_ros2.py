"""The stand-in robot (``stages.standin``) as a ROS 2 node: MuJoCo behind ``sensor_msgs/JointState``.

``python -m stages.standin_ros2 --task T --episodes N --seed S --out result.json`` steps the task's model with
the stand-in's hidden physical parameters (latency, sensor noise and all) and publishes its joint state as
``sim2edge-agent ros2`` (edge/ros2.py) reads it: every hinge and slide joint of the MJCF by name, position and
velocity, each with the hidden ``obs_noise``. Commands (a reach target) go on the command topic at each
episode's start, in the task's order. Actions are actuator controls (the bundle's output), ``Float64MultiArray``
or ``JointTrajectory`` (then only the one echoing the state's stamp answers it).

Lockstep with a deadline: after publishing a state the robot waits for its answer (the agent sends it at its
next period tick) up to ``DEADLINE_PERIODS``; a missing answer counts as *late* and the latest action received
is applied anyway. The physics thus advances one control period per agent period, whatever the two clocks'
phase, as in-process evaluation applies each action: episode ``k`` is ``BatchedEnv(task, 1, hidden, seed=S + k)``
there and here. Writes ``{robot, episodes: [{seed, success, return, steps, fell, late}]}`` and prints ``done``.

``--bag DIR`` records, from the first episode on, what went over the state and action topics as a rosbag2 (MCAP,
written with ``rosbags``): the bytes off the wire, at their receive time, as ``ros2 bag record`` stores them.
Episodes are then ``--gap`` seconds apart (silence on the state topic), where ``stages.collect`` splits them, and
each starts half a period after an agent tick, so that every later state is published just after one (on its
answer) and the collector's tick grid falls between states and answers.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import mujoco
import numpy as np

from edge.ros2 import COMMAND_QOS, CONTROL_QOS
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.sim.task import Task
from stages.standin import hidden_params, robot_id

import rclpy  # after edge.ros2, which names the RMW rclpy needs at import
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

SCALAR_JOINTS = (int(mujoco.mjtJoint.mjJNT_HINGE), int(mujoco.mjtJoint.mjJNT_SLIDE))
DEADLINE_PERIODS = 2.0
"""How long a state waits for its action, in control periods (the agent answers within one)."""


def joint_table(task: Task) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(names, qpos indices, qvel indices) of the model's hinge and slide joints: what the JointState carries."""
    m = task.model
    ids = [j for j in range(m.njnt) if m.jnt_type[j] in SCALAR_JOINTS]
    return [m.joint(j).name for j in ids], m.jnt_qposadr[ids], m.jnt_dofadr[ids]


class BagRecorder:
    """Raw subscriptions writing each message as received into a rosbag2 (MCAP); on once :attr:`recording`."""

    def __init__(self, node, path: Path, topics: dict) -> None:
        from rosbags.rosbag2 import StoragePlugin, Writer
        from rosbags.typesys import Stores, get_typestore

        self.recording = False
        self.writer = Writer(path, version=9, storage_plugin=StoragePlugin.MCAP)
        self.writer.open()
        store = get_typestore(Stores.ROS2_JAZZY)
        for topic, kind in topics.items():
            conn = self.writer.add_connection(topic, f"{kind.__module__.split('.')[0]}/msg/{kind.__name__}",
                                              typestore=store)
            node.create_subscription(kind, topic, lambda raw, c=conn: self._write(c, raw), CONTROL_QOS, raw=True)

    def _write(self, conn, raw: bytes) -> None:
        if self.recording:  # executor thread only: one writer call at a time
            self.writer.write(conn, time.time_ns(), raw)


class StandinNode:
    """The robot's side of the loop: publishes states and waits for the actions answering them."""

    def __init__(self, task: Task, topics: tuple[str, str, str], action_type: str, bag: Path | None = None) -> None:
        self.names, self.qadr, self.vadr = joint_table(task)
        self.node = rclpy.create_node("standin_robot")
        state, command, action = topics
        self.state = self.node.create_publisher(JointState, state, CONTROL_QOS)
        self.command = self.node.create_publisher(Float64MultiArray, command, COMMAND_QOS)
        kind = JointTrajectory if action_type == "joint_trajectory" else Float64MultiArray
        self.node.create_subscription(kind, action, self._on_action, CONTROL_QOS)
        self.action_topic = action
        self.bag = BagRecorder(self.node, bag, {state: JointState, action: kind}) if bag is not None else None
        self._cond = threading.Condition()
        self._controls: np.ndarray | None = None
        self._stamp = self._sent = None  # the latest action's echoed stamp (None: no stamp), the last state's
        self._heard = self._heard_at_send = 0

    def _on_action(self, msg) -> None:
        with self._cond:
            if isinstance(msg, JointTrajectory):
                self._controls, self._stamp = np.asarray(msg.points[0].positions), msg.header.stamp
            else:
                self._controls = np.asarray(msg.data)
            self._heard += 1
            self._cond.notify_all()

    def _answered(self) -> bool:
        return self._heard > self._heard_at_send and (self._stamp is None or self._stamp == self._sent)

    def answer(self, timeout_s: float) -> tuple[np.ndarray | None, bool]:
        """(the latest controls, whether they answer the last state) once answered or after ``timeout_s``."""
        with self._cond:
            on_time = self._cond.wait_for(self._answered, timeout_s)
            return self._controls, on_time

    def in_phase(self, period: float) -> None:
        """Return half a period after the agent's next action (its watchdog's, between episodes): a state published
        now lies mid-way between its ticks, so a recording resampled onto a grid from it has ticks between the
        states and the answers."""
        with self._cond:
            heard = self._heard
            self._cond.wait_for(lambda: self._heard > heard, 2 * period)
        time.sleep(period / 2)

    def connected(self) -> bool:
        return self.state.get_subscription_count() > 0 and self.node.count_publishers(self.action_topic) > 0

    def publish(self, qpos: np.ndarray, qvel: np.ndarray, noise: np.ndarray) -> None:
        """One JointState of the robot's joints, ``noise`` (2, joints) added."""
        msg = JointState(name=self.names, position=(qpos[self.qadr] + noise[0]).tolist(),
                         velocity=(qvel[self.vadr] + noise[1]).tolist())
        msg.header.stamp = self.node.get_clock().now().to_msg()
        with self._cond:
            self._sent, self._heard_at_send = msg.header.stamp, self._heard
        self.state.publish(msg)


def to_action(task: Task, controls: np.ndarray | None) -> np.ndarray:
    """(1, nu) normalized action from actuator controls (the default pose before any action arrived)."""
    if controls is None:
        return np.zeros((1, task.act_dim), np.float32)
    return np.clip((controls - task.action_default) / task.action_scale, -1.0, 1.0)[None].astype(np.float32)


def run_episode(robot: StandinNode, env: BatchedEnv, rng: np.random.Generator) -> dict:
    """One episode, each state answered (or late) before the physics steps."""
    task, noise_std = env.task, env.centre.obs_noise
    if task.commands:
        robot.command.publish(Float64MultiArray(data=env.command[0].astype(float).tolist()))
    late = 0
    while True:
        robot.publish(env.qpos[0], env.qvel[0], rng.standard_normal((2, len(robot.names))) * noise_std)
        controls, on_time = robot.answer(DEADLINE_PERIODS * task.ctrl_dt)
        late += not on_time
        r = env.step(to_action(task, controls))
        if r.done[0]:
            return {"success": bool(r.finished_success[0]), "return": float(r.finished_returns[0]),
                    "steps": int(r.finished_lengths[0]), "fell": bool(r.terminated[0]), "late": late}


def episode_env(task: Task, params: PhysicalParams, seed: int) -> BatchedEnv:
    """One episode's environment, reset once more as ``stages.twin.episodes.run_episodes`` does: the same initial
    state as in-process evaluation of ``seed``."""
    env = BatchedEnv(task, 1, params=params, seed=seed, nthread=1)
    env.reset()
    return env


def wait_for_agent(robot: StandinNode, env: BatchedEnv, timeout_s: float = 30.0) -> None:
    """Until the agent answers: discovery, then the first episode's initial state re-sent each period."""
    end = time.monotonic() + timeout_s
    while True:
        if time.monotonic() > end:
            raise TimeoutError(f"no agent answered on {robot.action_topic} in {timeout_s:g} s")
        if robot.connected():
            robot.publish(env.qpos[0], env.qvel[0], np.zeros((2, len(robot.names))))
            if robot.answer(env.task.ctrl_dt)[1]:
                return
        else:
            time.sleep(env.task.ctrl_dt)


def serve(task_name: str, episodes: int, seed: int, profile: str = "global",
          topics: tuple[str, str, str] = ("/joint_states", "/sim2edge/command", "/sim2edge/action"),
          action_type: str = "joint_trajectory", bag: Path | None = None, gap_s: float = 1.0) -> dict:
    """Run ``episodes`` episodes (seeds ``seed``, ``seed + 1``, …) against whatever node answers on the topics;
    with ``bag``, record them there, ``gap_s`` apart."""
    task = load(task_name)
    params = hidden_params(task.name, profile)
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    try:
        robot = StandinNode(task, topics, action_type, bag)
        executor = SingleThreadedExecutor()
        executor.add_node(robot.node)
        spinner = threading.Thread(target=executor.spin, daemon=True)
        spinner.start()
        envs = [episode_env(task, params, seed + k) for k in range(episodes)]
        wait_for_agent(robot, envs[0])
        rng, out = np.random.default_rng(seed), []
        for k, env in enumerate(envs):
            if robot.bag is not None:
                time.sleep(gap_s)
                robot.bag.recording = True  # the action in_phase waits for too: the first tick's command if late
                robot.in_phase(task.ctrl_dt)
            record = run_episode(robot, env, rng)
            out.append({"seed": seed + k, **record})
        executor.shutdown()
        spinner.join()
        if robot.bag is not None:
            robot.bag.writer.close()
    finally:
        rclpy.try_shutdown()
    return {"robot": robot_id(task.name, profile), "episodes": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="global")
    p.add_argument("--state-topic", default="/joint_states")
    p.add_argument("--command-topic", default="/sim2edge/command")
    p.add_argument("--action-topic", default="/sim2edge/action")
    p.add_argument("--action-type", choices=("float64_array", "joint_trajectory"), default="joint_trajectory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bag", type=Path)
    p.add_argument("--gap", type=float, default=1.0)
    a = p.parse_args()
    result = serve(a.task, a.episodes, a.seed, a.profile, (a.state_topic, a.command_topic, a.action_topic),
                   a.action_type, a.bag, a.gap)
    a.out.write_text(json.dumps(result))
    print("done", flush=True)


if __name__ == "__main__":
    main()
