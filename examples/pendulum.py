"""Bring your own robot: a task defined outside sim2edge, used as ``--task examples.pendulum:Pendulum``.

A task is a frozen dataclass subclassing :class:`stages.sim.task.Task`: point ``mjcf`` at
your model, name the observation and action terms (one action term per actuator, in
actuator order), and write the vectorized initial state, observation, reward and
termination. Shapes: ``qpos`` (N, nq), ``qvel`` (N, nv), ``action`` (N, nu) in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stages.sim.params import Randomization
from stages.sim.task import Task, Term


@dataclass(frozen=True)
class Pendulum(Task):
    name: str = "pendulum"
    mjcf: Path = Path(__file__).with_name("pendulum.xml")
    observations: tuple[Term, ...] = (Term("cos", "1"), Term("sin", "1"), Term("angvel", "rad/s"))
    actions: tuple[Term, ...] = (Term("torque", "N m"),)
    decimation: int = 2
    episode_steps: int = 200
    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.3, actuator_gain=0.1, mass=0.1))
    success_threshold: float = 150.0
    mass_bodies: tuple[str, ...] = ("pole",)

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # angle from upright ~ U(±0.3) rad, angular velocity ~ U(±0.2) rad/s
        return rng.uniform(-0.3, 0.3, (n, 1)), rng.uniform(-0.2, 0.2, (n, 1))

    def observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return np.concatenate([np.cos(qpos), np.sin(qpos), qvel], axis=1).astype(np.float32)

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray) -> np.ndarray:
        return (np.cos(qpos[:, 0]) - 0.01 * qvel[:, 0] ** 2 - 0.01 * np.sum(action**2, axis=1)).astype(np.float32)

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return np.abs(qpos[:, 0]) > 1.0
