"""Cart-pole observed as a robot's joint states report it: ``--task examples.joint_cartpole:JointCartPole``.

The built-in cart-pole's contract reads cos/sin of the pole angle, which a ``sensor_msgs/JointState`` cannot carry;
this task observes ``slider``/``hinge`` position and velocity only, the terms ``sim2edge-agent ros2`` fills from a
JointState by joint name (``<joint>_pos``, ``<joint>_vel``). It keeps the name ``cartpole``, so the stand-in robot
(``stages.standin``, ``python -m stages.standin_ros2``) steps it with cart-pole's hidden physics. The pole starts up to
0.5 rad off upright; 100-step (2 s) episodes, success at return 60.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.sim.cartpole import CartPole
from stages.sim.task import Term

JOINT_TERMS = ("slider_pos", "hinge_pos", "slider_vel", "hinge_vel")


@dataclass(frozen=True)
class JointCartPole(CartPole):
    observations: tuple[Term, ...] = tuple(Term(n, "m" if n.startswith("slider") else "rad") for n in JOINT_TERMS)
    episode_steps: int = 100
    success_threshold: float = 60.0

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.uniform([-0.2, -0.5], [0.2, 0.5], size=(n, 2)), rng.uniform(-0.1, 0.1, size=(n, 2))

    def observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        return np.concatenate([qpos, qvel], axis=1).astype(np.float32)
