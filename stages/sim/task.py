"""What a task is: a robot MJCF plus its observation, action, reward and termination terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mujoco
import numpy as np

from stages.sim.params import PhysicalParams, Randomization


@dataclass(frozen=True)
class Term:
    """One named observation or action component, with its unit."""

    name: str
    unit: str


@dataclass(frozen=True)
class Task:
    """Base class of every task. Subclasses set the fields and implement the vectorized terms.

    Shapes: ``qpos`` (N, nq), ``qvel`` (N, nv), ``action`` (N, nu) in [-1, 1].
    """

    name: str
    mjcf: Path
    observations: tuple[Term, ...]
    actions: tuple[Term, ...]
    decimation: int
    episode_steps: int
    randomization: Randomization = field(default_factory=Randomization)
    success_threshold: float = 0.0
    """An episode succeeds when it is not terminated early, its return reaches this and ``succeeded`` holds."""
    mass_bodies: tuple[str, ...] = ()
    """Bodies whose mass the ``mass`` parameter scales (the payload); empty = every body but the world."""

    replayed_joints: tuple[str, ...] = ()
    """Joints whose positions calibration compares with the logs (the robot's own); empty = every joint."""

    @cached_property
    def replayed_qpos(self) -> np.ndarray:
        """qpos indices of ``replayed_joints`` (every qpos if empty)."""
        m = self.model
        if not self.replayed_joints:
            return np.arange(m.nq)
        ids = [mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, j) for j in self.replayed_joints]
        if min(ids) < 0:
            raise ValueError(f"task {self.name!r}: replayed joint {self.replayed_joints[ids.index(-1)]!r} "
                             f"is not in {self.mjcf.name}")
        return np.array([m.jnt_qposadr[i] for i in ids])

    @cached_property
    def model(self) -> mujoco.MjModel:
        """The nominal MuJoCo model (loaded once)."""
        return mujoco.MjModel.from_xml_path(str(self.mjcf))

    @cached_property
    def mass_mask(self) -> np.ndarray:
        """(nbody,) bool: the bodies ``PhysicalParams.mass`` scales."""
        m = self.model
        if not self.mass_bodies:
            return np.arange(m.nbody) > 0
        mask = np.zeros(m.nbody, dtype=bool)
        for name in self.mass_bodies:
            body = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, name)
            if body < 0:
                raise ValueError(f"task {self.name!r}: mass body {name!r} is not in {self.mjcf.name}")
            mask[body] = True
        return mask

    @property
    def ctrl_dt(self) -> float:
        """Control period in seconds."""
        return self.model.opt.timestep * self.decimation

    @property
    def obs_dim(self) -> int:
        return len(self.observations)

    @property
    def act_dim(self) -> int:
        return len(self.actions)

    @cached_property
    def action_scale(self) -> np.ndarray:
        """Half-width of each actuator's control range: ctrl = default + scale * action."""
        low, high = self.model.actuator_ctrlrange.T
        return ((high - low) / 2).astype(np.float32)

    @cached_property
    def action_default(self) -> np.ndarray:
        low, high = self.model.actuator_ctrlrange.T
        return ((high + low) / 2).astype(np.float32)

    def nominal_params(self) -> PhysicalParams:
        return PhysicalParams()

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def observe(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def succeeded(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        """(N,) bool: whether the final state of an episode counts as success (default: always)."""
        return np.ones(len(qpos), dtype=bool)

    def validate(self) -> None:
        """Fail at registration with the offending term named."""
        m = self.model
        if m.nu != self.act_dim:
            raise ValueError(f"task {self.name!r}: {self.act_dim} action terms but the MJCF has {m.nu} actuators")
        if not np.all(m.actuator_ctrllimited):
            raise ValueError(f"task {self.name!r}: every actuator needs a ctrlrange")
        self.mass_mask  # noqa: B018 - resolves the body names
        self.replayed_qpos  # noqa: B018 - resolves the joint names
        qpos, qvel = self.initial_state(np.random.default_rng(0), 2)
        obs = self.observe(qpos, qvel)
        if obs.shape != (2, self.obs_dim):
            raise ValueError(f"task {self.name!r}: observe() gave shape {obs.shape}, expected (N, {self.obs_dim})")
        if not np.all(np.isfinite(obs)):
            raise ValueError(f"task {self.name!r}: observe() gave NaN/Inf at the initial state")
