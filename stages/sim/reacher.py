"""Reacher: gymnasium's ``Reacher-v5`` — same MJCF, observation, reward, reset and episode length.

The model is gymnasium's own bundled ``reacher.xml`` (loaded from the installed package,
nothing downloaded), so a policy here and a Stable-Baselines3 policy on ``Reacher-v5``
see the same physics. ``tests/test_reacher.py`` steps both side by side. One difference:
gymnasium reads the fingertip from ``data.xpos``, which ``mj_step`` computes before its
last integration substep, so its tip-to-target lags by one 10 ms substep; here the
fingertip comes from the current joint angles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np

from stages.sim.params import Randomization
from stages.sim.task import Task, Term

LINK = 0.1
"""Upper-arm length (m); the fingertip sits 0.11 m past the elbow (``reacher.xml``)."""
TIP = 0.11


def gymnasium_mjcf(file: str) -> Path:
    """One of the MJCFs the installed gymnasium package ships (``reacher.xml``, ``ant.xml``, ``pusher.xml`` …)."""
    return Path(str(files("gymnasium") / "envs" / "mujoco" / "assets" / file))


def fingertip(qpos: np.ndarray) -> np.ndarray:
    """Planar forward kinematics of the two-link arm: fingertip (x, y), (N, 2)."""
    a, b = qpos[:, 0], qpos[:, 0] + qpos[:, 1]
    return np.stack([LINK * np.cos(a) + TIP * np.cos(b), LINK * np.sin(a) + TIP * np.sin(b)], axis=1)


def _distance(qpos: np.ndarray) -> np.ndarray:
    d = fingertip(qpos) - qpos[:, 2:]
    return np.sqrt(np.einsum("ij,ij->i", d, d))


@dataclass(frozen=True)
class Reacher(Task):
    name: str = "reacher"
    mjcf: Path = field(default_factory=lambda: gymnasium_mjcf("reacher.xml"))
    observations: tuple[Term, ...] = (
        *(Term(f"{f}_{j}", "1", low=-1, high=1) for f in ("cos", "sin") for j in ("shoulder", "elbow")),
        Term("target_x", "m"), Term("target_y", "m"), Term("shoulder_vel", "rad/s"), Term("elbow_vel", "rad/s"),
        Term("tip_to_target_x", "m"), Term("tip_to_target_y", "m"),
    )
    actions: tuple[Term, ...] = (Term("shoulder", "N m"), Term("elbow", "N m"))  # motor gear 200: ctrl 1 is 200 N m
    decimation: int = 2  # Reacher-v5 frame_skip
    episode_steps: int = 50  # Reacher-v5 max_episode_steps
    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.2, actuator_gain=0.1, mass=0.2))
    success_threshold: float = -np.inf
    mass_bodies: tuple[str, ...] = ("body0", "body1", "fingertip")
    replayed_joints: tuple[str, ...] = ("joint0", "joint1")  # not the target's slide joints
    joint_window: int | None = 46  # one window per 50-step episode: its joint frictions (0.02 N m) need long replays
    fit_starts: bool = True
    success_distance: float = 0.02
    """An episode succeeds when it ends with the fingertip within this distance (m) of the target."""

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # Reacher-v5 reset: joints ~ init + U(±0.1), goal ~ U(±0.2)² inside the 0.2 m disc, arm vel ~ U(±0.005)
        qpos = rng.uniform(-0.1, 0.1, size=(n, 4)) + self.model.qpos0
        goal = rng.uniform(-0.2, 0.2, size=(n, 2))
        while (far := np.linalg.norm(goal, axis=1) >= 0.2).any():
            goal[far] = rng.uniform(-0.2, 0.2, size=(int(far.sum()), 2))
        qpos[:, 2:] = goal
        qvel = rng.uniform(-0.005, 0.005, size=(n, 4))
        qvel[:, 2:] = 0.0
        return qpos, qvel

    def observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        theta = qpos[:, :2]
        delta = fingertip(qpos) - qpos[:, 2:]
        return np.concatenate([np.cos(theta), np.sin(theta), qpos[:, 2:], qvel[:, :2], delta], axis=1).astype(np.float32)

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray) -> np.ndarray:
        return (-_distance(qpos) - np.einsum("ij,ij->i", action, action)).astype(np.float32)

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return np.zeros(len(qpos), dtype=bool)

    def succeeded(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return _distance(qpos) < self.success_distance
