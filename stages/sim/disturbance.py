"""Disturbances of an episode that are not physical parameters: sensor bias, pushes, initial-state spread."""

from __future__ import annotations

from typing import Literal

import mujoco
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stages.sim.params import actuated_dofs


class Disturbance(BaseModel):
    """What an evaluation scenario (or a training run) does to an episode besides its physics."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    obs_bias: float = Field(0.0, ge=0, description="Constant per-episode offset on every observation term, ~U(±value).")
    push: float = Field(0.0, ge=0, description="Push strength, see ``push_on``.")
    push_on: Literal["joints", "base"] = Field(
        "joints", description="joints: a generalized force on the actuated joints, ``push`` × each actuator's peak "
                              "force, random sign per push; base: a horizontal force on the floating base (a free "
                              "joint's translational DOFs), ``push`` × the robot's weight, random x–y direction per push.")
    push_every: int = Field(25, ge=1, description="Control steps between pushes (random phase per episode).")
    push_steps: int = Field(2, ge=1, description="Control steps a push lasts.")
    init_spread: float = Field(1.0, gt=0, description="Scale on the initial state's deviation from the model's "
                                                      "reference pose (robot joints and all velocities).")


def peak_forces(model: mujoco.MjModel) -> np.ndarray:
    """(nv,) each actuated DOF's peak actuator force (|gear| × its force limit, else × gain × largest |ctrl|); 0 elsewhere."""
    force = np.zeros(model.nv)
    for a in range(model.nu):
        if model.actuator_trntype[a] == mujoco.mjtTrn.mjTRN_JOINT:
            dof = model.jnt_dofadr[model.actuator_trnid[a, 0]]
            peak = (np.abs(model.actuator_forcerange[a]).max() if model.actuator_forcelimited[a]
                    else abs(model.actuator_gainprm[a, 0]) * np.abs(model.actuator_ctrlrange[a]).max())
            force[dof] = abs(model.actuator_gear[a, 0]) * peak
    return np.where(actuated_dofs(model), force, 0.0)


def push_basis(model: mujoco.MjModel, d: Disturbance, task: str) -> np.ndarray:
    """(k, nv) the push force along each of its k directions; a push is ``coefficients @ basis``.

    joints: one row, ``push`` × each actuated DOF's peak force. base: two rows, the world x and y force
    (``push`` × weight of the free joint's subtree, nominal masses) on the model's first free joint."""
    if d.push_on == "joints":
        return d.push * peak_forces(model)[None]
    free = np.flatnonzero(model.jnt_type == mujoco.mjtJoint.mjJNT_FREE)
    if not len(free):
        raise ValueError(f"task {task!r}: Disturbance.push_on='base' pushes a floating base, but the task's model "
                         "has no free joint (use push_on='joints')")
    weight = model.body_subtreemass[model.jnt_bodyid[free[0]]] * np.linalg.norm(model.opt.gravity)
    basis = np.zeros((2, model.nv))
    dof = model.jnt_dofadr[free[0]]
    basis[[0, 1], [dof, dof + 1]] = d.push * weight
    return basis


def push_coefficients(d: Disturbance, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, k) new pushes' coefficients on :func:`push_basis`: a random sign (joints) or unit x–y direction (base)."""
    if d.push_on == "joints":
        return rng.choice([-1.0, 1.0], n)[:, None]
    angle = rng.uniform(0.0, 2 * np.pi, n)
    return np.stack([np.cos(angle), np.sin(angle)], axis=1)


def spread(qpos: np.ndarray, qvel: np.ndarray, reference: np.ndarray, joints: np.ndarray,
           scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Scale the deviation of the ``joints`` qpos from ``reference`` and every velocity by ``scale``."""
    if scale == 1.0:
        return qpos, qvel
    qpos = qpos.copy()
    qpos[:, joints] = reference[joints] + scale * (qpos[:, joints] - reference[joints])
    return qpos, qvel * scale
