"""Quadruped: track a commanded base velocity (vx, vy, yaw rate) on flat ground with 12 position servos.

The classic 48-term observation of legged_gym / Isaac Lab: base linear and angular velocity
in the body frame, gravity projected into the body frame, the command, joint positions relative
to the standing pose, joint velocities and the last action. The base terms come from the MJCF's
IMU sensors (velocimeter, gyro, orientation), each with its own noise. The command is three
task commands, sampled per episode; the bundle's I/O contract marks them as inputs the robot's
software provides. The critic also sees the torso's height, which no sensor on the robot gives
(a privileged term). A fall — torso below ``min_height`` or tilted past ``max_tilt`` —
terminates the episode; evaluation counts early terminations as falls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mujoco
import numpy as np

from stages.sim.kinematics import quat_to_mat
from stages.sim.params import Randomization
from stages.sim.task import Command, Metric, Task, Term

ASSETS = Path(__file__).parent / "assets"
LEGS = ("FR", "FL", "RR", "RL")
JOINTS = tuple(f"{leg}_{j}" for leg in LEGS for j in ("abduction", "hip", "knee"))
STAND_HEIGHT = 0.33
"""Initial torso height (m); the standing pose settles about 2 cm lower."""


@dataclass(frozen=True)
class Quadruped(Task):
    name: str = "quadruped"
    mjcf: Path = ASSETS / "quadruped.xml"
    observations: tuple[Term, ...] = (
        *(Term(f"base_v{a}", "m/s", noise=0.02, sensor="imu_velocity") for a in "xyz"),  # body frame (velocimeter)
        *(Term(f"base_w{a}", "rad/s", noise=0.02, sensor="imu_gyro") for a in "xyz"),  # gyro
        *(Term(f"gravity_{a}", "1", low=-1, high=1) for a in "xyz"),  # unit gravity in the body frame
        Term("command_vx", "m/s", source="command"), Term("command_vy", "m/s", source="command"),
        Term("command_yaw_rate", "rad/s", source="command"),
        *(Term(f"{j}_pos", "rad") for j in JOINTS),  # from the standing pose (observation_offsets)
        *(Term(f"{j}_vel", "rad/s") for j in JOINTS),
        *(Term(f"last_action_{j}", "1", low=-1, high=1) for j in JOINTS),  # the clipped action
    )
    # servo setpoints (rad): ctrl = standing pose + 0.5 rad · action
    actions: tuple[Term, ...] = tuple(Term(j, "rad", joint=j) for j in JOINTS)
    decimation: int = 4  # 5 ms physics, 20 ms control period (50 Hz)
    episode_steps: int = 250  # 5 s
    action_history: bool = True
    # servo gain, joint damping and the torso's mass (payload) ~ U(1 ± r); Coulomb friction ~ U(0, 0.1) N m
    randomization: Randomization = field(default_factory=lambda: Randomization(
        damping=0.2, actuator_gain=0.1, mass=0.2, friction=0.1))
    success_threshold: float = -np.inf
    """Success = the episode ran to its end without a fall."""
    mass_bodies: tuple[str, ...] = ("torso",)
    replayed_joints: tuple[str, ...] = JOINTS
    start_smoothing: int = 5
    commands: tuple[Command, ...] = (Command("command_vx", "m/s", -1.0, 1.0), Command("command_vy", "m/s", -0.6, 0.6),
                                     Command("command_yaw_rate", "rad/s", -1.0, 1.0))
    """One velocity command per episode, uniform in these ranges."""
    sensors: tuple[str, ...] = ("imu_velocity", "imu_gyro", "imu_orientation")
    privileged: tuple[Term, ...] = (Term("torso_height", "m"),)
    metrics: tuple[Metric, ...] = (Metric("velocity_error", "m/s"),)
    """How far the base's planar velocity is from the command (falls: the success rate already counts them)."""
    min_height: float = 0.14
    max_tilt: float = 1.0
    """A fall: torso below ``min_height`` (m) or tilted more than ``max_tilt`` (rad) from upright."""
    # reward weights (per control step), legged_gym's flat-ground terms
    tracking_sigma: float = 0.25
    weights: tuple[tuple[str, float], ...] = (
        ("track_lin_vel", 1.0), ("track_yaw_rate", 0.5), ("lin_vel_z", -2.0), ("ang_vel_xy", -0.05),
        ("orientation", -1.0), ("torques", -1e-4), ("action_rate", -0.01),
    )

    def _adr(self, names: tuple[str, ...], table: np.ndarray) -> np.ndarray:
        m = self.model
        return np.array([table[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, j)] for j in names])

    @cached_property
    def joint_qpos(self) -> np.ndarray:
        return self._adr(JOINTS, self.model.jnt_qposadr)

    @cached_property
    def joint_qvel(self) -> np.ndarray:
        return self._adr(JOINTS, self.model.jnt_dofadr)

    @cached_property
    def reference_qpos(self) -> np.ndarray:
        """Standing: torso at ``STAND_HEIGHT``, upright, joints at the servo ranges' centres."""
        q = self.model.qpos0.copy()
        q[2] = STAND_HEIGHT
        q[self.joint_qpos] = self.action_default
        return q

    def observation_offsets(self) -> np.ndarray:
        """Joint positions are observed from the standing pose (the servo ranges' centres)."""
        offsets = np.zeros(self.obs_dim, np.float32)
        offsets[12:12 + len(JOINTS)] = self.action_default  # after base, gravity and command
        return offsets

    def base(self, qpos: np.ndarray, qvel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Body-frame linear velocity, angular velocity and unit gravity, each (N, 3)."""
        rot = quat_to_mat(qpos[:, 3:7])  # body → world
        lin = np.einsum("nji,nj->ni", rot, qvel[:, 0:3])  # the free joint's linear velocity is in the world frame
        gravity = -rot[:, 2, :]  # Rᵀ (0, 0, −1)
        return lin, qvel[:, 3:6], gravity  # its angular velocity is in the body frame

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # standing, heading ~ U(±π), joints ~ standing + U(±0.1) rad, base velocity ~ U(±0.1)
        qpos = np.tile(self.reference_qpos, (n, 1))
        yaw = rng.uniform(-np.pi, np.pi, n)
        qpos[:, 3:7] = np.stack([np.cos(yaw / 2), np.zeros(n), np.zeros(n), np.sin(yaw / 2)], axis=1)
        qpos[:, self.joint_qpos] += rng.uniform(-0.1, 0.1, (n, len(JOINTS)))
        qvel = np.zeros((n, self.model.nv))
        qvel[:, 0:6] = rng.uniform(-0.1, 0.1, (n, 6))
        return qpos, qvel

    def observe(self, qpos: np.ndarray, qvel: np.ndarray, last_action: np.ndarray, command: np.ndarray,
                sensor: dict[str, np.ndarray]) -> np.ndarray:
        gravity = -quat_to_mat(sensor["imu_orientation"])[:, 2, :]  # Rᵀ (0, 0, −1)
        return np.concatenate([
            sensor["imu_velocity"], sensor["imu_gyro"], gravity, command,
            qpos[:, self.joint_qpos] - self.action_default, qvel[:, self.joint_qvel], last_action,
        ], axis=1).astype(np.float32)

    def observe_privileged(self, qpos: np.ndarray, qvel: np.ndarray, **inputs: np.ndarray) -> np.ndarray:
        return qpos[:, 2:3].astype(np.float32)

    def torques(self, qpos: np.ndarray, action: np.ndarray) -> np.ndarray:
        """(N, 12) the servos' nominal torque kp·(setpoint − q), clipped to their force range."""
        m = self.model
        setpoint = self.action_default + self.action_scale * action
        tau = m.actuator_gainprm[:, 0] * (setpoint - qpos[:, self.joint_qpos])
        return np.clip(tau, m.actuator_forcerange[:, 0], m.actuator_forcerange[:, 1])

    def reward_terms(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray, last_action: np.ndarray,
                     command: np.ndarray) -> dict[str, np.ndarray]:
        """Each reward term (N,), unweighted, from the true state (the simulator's, not the sensors')."""
        lin, ang, gravity = self.base(qpos, qvel)
        return {
            "track_lin_vel": np.exp(-np.sum((command[:, :2] - lin[:, :2]) ** 2, axis=1) / self.tracking_sigma),
            "track_yaw_rate": np.exp(-((command[:, 2] - ang[:, 2]) ** 2) / self.tracking_sigma),
            "lin_vel_z": lin[:, 2] ** 2,
            "ang_vel_xy": np.sum(ang[:, :2] ** 2, axis=1),
            "orientation": np.sum(gravity[:, :2] ** 2, axis=1),
            "torques": np.sum(self.torques(qpos, action) ** 2, axis=1),
            "action_rate": np.sum((action - last_action) ** 2, axis=1),
        }

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray, last_action: np.ndarray,
               command: np.ndarray, sensor: dict[str, np.ndarray]) -> np.ndarray:
        terms = self.reward_terms(qpos, qvel, action, last_action, command)
        return sum(w * terms[name] for name, w in self.weights).astype(np.float32)

    def step_metrics(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                     sensor: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``velocity_error``: |commanded − measured| of the body-frame planar (x, y) base velocity, in m/s."""
        lin, _, _ = self.base(qpos, qvel)
        return {"velocity_error": np.linalg.norm(command[:, :2] - lin[:, :2], axis=1)}

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                   sensor: dict[str, np.ndarray]) -> np.ndarray:
        """A fall: the torso too low or tilted too far (gravity's body-frame z above −cos(max_tilt))."""
        _, _, gravity = self.base(qpos, qvel)
        return (qpos[:, 2] < self.min_height) | (gravity[:, 2] > -np.cos(self.max_tilt))
