"""A robot this project did not write: gymnasium's Ant (``ant.xml``), tracking a commanded base velocity.

The MJCF is loaded from the installed gymnasium package and never edited. The IMU a real quadruped
carries is added to its parsed ``MjSpec`` in :meth:`AntVelocity.edit`: a site on the torso with a gyro,
an orientation sensor (``framequat``) and a velocimeter. The actor reads the gyro, gravity from the
orientation, the joints and the command (vx, vy, yaw rate, resampled every 2 s as legged training
does); the base's linear velocity, which no sensor on the robot measures well, is privileged: only the
critic sees it. A fall — torso below ``min_height`` or tilted past ``max_tilt`` — ends the episode.

Use it as ``--task examples.gym_ant:AntVelocity``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mujoco
import numpy as np

from stages.sim.kinematics import quat_to_mat
from stages.sim.params import Randomization
from stages.sim.reacher import gymnasium_mjcf
from stages.sim.task import Command, Task, Term

JOINTS = ("hip_4", "ankle_4", "hip_1", "ankle_1", "hip_2", "ankle_2", "hip_3", "ankle_3")
"""In the order of ``ant.xml``'s actuators."""


@dataclass(frozen=True)
class AntVelocity(Task):
    name: str = "ant_velocity"
    mjcf: Path = field(default_factory=lambda: gymnasium_mjcf("ant.xml"))
    observations: tuple[Term, ...] = (
        *(Term(f"base_w{a}", "rad/s", noise=0.02, sensor="imu_gyro") for a in "xyz"),  # gyro
        *(Term(f"gravity_{a}", "1", low=-1, high=1) for a in "xyz"),  # unit gravity in the body frame
        Term("command_vx", "m/s", source="command"), Term("command_vy", "m/s", source="command"),
        Term("command_yaw_rate", "rad/s", source="command"),
        *(Term(f"{j}_pos", "rad") for j in JOINTS),
        *(Term(f"{j}_vel", "rad/s") for j in JOINTS),
    )
    actions: tuple[Term, ...] = tuple(Term(j, "N m", joint=j) for j in JOINTS)  # motors, gear 150
    decimation: int = 5  # gymnasium's Ant frame_skip: 10 ms physics, 50 ms control period
    episode_steps: int = 100  # 5 s
    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.2, actuator_gain=0.1, mass=0.2))
    success_threshold: float = -np.inf
    """Success = the episode ran to its end without a fall."""
    mass_bodies: tuple[str, ...] = ("torso",)
    replayed_joints: tuple[str, ...] = JOINTS
    commands: tuple[Command, ...] = (Command("command_vx", "m/s", -0.5, 0.5, resample_steps=40),
                                     Command("command_vy", "m/s", -0.5, 0.5, resample_steps=40),
                                     Command("command_yaw_rate", "rad/s", -0.5, 0.5, resample_steps=40))
    sensors: tuple[str, ...] = ("imu_gyro", "imu_orientation", "imu_velocity")
    privileged: tuple[Term, ...] = tuple(Term(f"base_v{a}", "m/s") for a in "xyz")  # body frame (velocimeter)
    min_height: float = 0.3
    max_tilt: float = 1.0
    tracking_sigma: float = 0.25
    control_cost: float = 0.005

    def edit(self, spec: mujoco.MjSpec) -> None:
        spec.body("torso").add_site(name="imu")
        for name, kind in (("imu_gyro", mujoco.mjtSensor.mjSENS_GYRO), ("imu_velocity", mujoco.mjtSensor.mjSENS_VELOCIMETER)):
            spec.add_sensor(name=name, type=kind, objtype=mujoco.mjtObj.mjOBJ_SITE, objname="imu")
        spec.add_sensor(name="imu_orientation", type=mujoco.mjtSensor.mjSENS_FRAMEQUAT,
                        objtype=mujoco.mjtObj.mjOBJ_SITE, objname="imu")

    @cached_property
    def joint_qpos(self) -> np.ndarray:
        return np.array([self.model.joint(j).qposadr[0] for j in JOINTS])

    @cached_property
    def joint_qvel(self) -> np.ndarray:
        return np.array([self.model.joint(j).dofadr[0] for j in JOINTS])

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # gymnasium's Ant reset: qpos0 + U(±0.1), qvel ~ 0.1·N(0, 1); heading ~ U(±π)
        qpos = np.tile(self.model.qpos0, (n, 1))
        yaw = rng.uniform(-np.pi, np.pi, n)
        qpos[:, 3:7] = np.stack([np.cos(yaw / 2), np.zeros(n), np.zeros(n), np.sin(yaw / 2)], axis=1)
        qpos[:, self.joint_qpos] += rng.uniform(-0.1, 0.1, (n, len(JOINTS)))
        return qpos, 0.1 * rng.standard_normal((n, self.model.nv))

    def gravity(self, sensor: dict[str, np.ndarray]) -> np.ndarray:
        return -quat_to_mat(sensor["imu_orientation"])[:, 2, :]  # Rᵀ (0, 0, −1)

    def observe(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray, sensor: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([sensor["imu_gyro"], self.gravity(sensor), command, qpos[:, self.joint_qpos],
                               qvel[:, self.joint_qvel]], axis=1).astype(np.float32)

    def observe_privileged(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                           sensor: dict[str, np.ndarray]) -> np.ndarray:
        return sensor["imu_velocity"].astype(np.float32)

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray, command: np.ndarray,
               sensor: dict[str, np.ndarray]) -> np.ndarray:
        lin, yaw_rate = sensor["imu_velocity"][:, :2], sensor["imu_gyro"][:, 2]
        track = np.exp(-np.sum((command[:, :2] - lin) ** 2, axis=1) / self.tracking_sigma)
        track_yaw = np.exp(-((command[:, 2] - yaw_rate) ** 2) / self.tracking_sigma)
        return (track + 0.5 * track_yaw - self.control_cost * np.sum(action**2, axis=1)).astype(np.float32)

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                   sensor: dict[str, np.ndarray]) -> np.ndarray:
        """A fall: the torso too low or tilted too far (gravity's body-frame z above −cos(max_tilt))."""
        return (qpos[:, 2] < self.min_height) | (self.gravity(sensor)[:, 2] > -np.cos(self.max_tilt))
