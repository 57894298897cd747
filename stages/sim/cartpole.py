"""Cart-pole balance: keep the pole upright and the cart near the centre."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stages.sim.params import Randomization
from stages.sim.task import Task, Term

ASSETS = Path(__file__).parent / "assets"


@dataclass(frozen=True)
class CartPole(Task):
    name: str = "cartpole"
    mjcf: Path = ASSETS / "cartpole.xml"
    observations: tuple[Term, ...] = (
        Term("cart_pos", "m"),
        Term("pole_cos", "1", low=-1, high=1),
        Term("pole_sin", "1", low=-1, high=1),
        Term("cart_vel", "m/s"),
        Term("pole_angvel", "rad/s"),
    )
    actions: tuple[Term, ...] = (Term("slide", "N"),)  # motor gear 10: ctrl 1 is 10 N (IOSpec's ``gear``)
    decimation: int = 2
    episode_steps: int = 250
    # damping, gain and mass scale ~ U(1 ± r) around the twin's values
    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.3, actuator_gain=0.15, mass=0.2))
    success_threshold: float = 150.0
    mass_bodies: tuple[str, ...] = ("pole",)
    max_angle: float = 0.6
    max_cart: float = 1.6

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # cart ~ U(±0.2) m, pole ~ U(±0.15) rad, velocities ~ U(±0.1)
        qpos = rng.uniform([-0.2, -0.15], [0.2, 0.15], size=(n, 2))
        qvel = rng.uniform(-0.1, 0.1, size=(n, 2))
        return qpos, qvel

    def observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        x, theta = qpos[:, 0], qpos[:, 1]
        return np.stack([x, np.cos(theta), np.sin(theta), qvel[:, 0], qvel[:, 1]], axis=1).astype(np.float32)

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray) -> np.ndarray:
        upright = np.cos(qpos[:, 1])
        centred = 0.5 * qpos[:, 0] ** 2
        effort = 0.01 * np.sum(action**2, axis=1)
        motion = 0.05 * qvel[:, 0] ** 2 + 0.01 * qvel[:, 1] ** 2
        return (upright - centred - effort - motion).astype(np.float32)

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return (np.abs(qpos[:, 1]) > self.max_angle) | (np.abs(qpos[:, 0]) > self.max_cart)
