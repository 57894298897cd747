"""Physical parameters of a robot model, and pure randomization around them.

Parameters are multiplicative scales on the nominal MJCF values, so one set of names
fits every robot: ``damping`` (all joint damping), ``actuator_gain`` (all actuator gears),
``mass`` (the masses of the task's ``mass_bodies``: scaling every mass together with
damping and gain would leave the dynamics unchanged, so it is a payload-like scale), plus ``latency_steps`` (action delay in control steps) and
``obs_noise`` (std of additive Gaussian observation noise, in observation units).
"""

from __future__ import annotations

import mujoco
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

SCALED = ("damping", "actuator_gain", "mass")


class PhysicalParams(BaseModel):
    """Scales on the nominal model plus latency and sensor noise."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    damping: float = Field(1.0, gt=0, description="Scale on every joint's damping.")
    actuator_gain: float = Field(1.0, gt=0, description="Scale on every actuator's gear.")
    mass: float = Field(1.0, gt=0, description="Scale on the mass of the task's mass bodies.")
    latency_steps: int = Field(0, ge=0, description="Action delay in control steps.")
    obs_noise: float = Field(0.0, ge=0, description="Std of additive observation noise.")


class Randomization(BaseModel):
    """Relative half-widths of uniform randomization around a centre PhysicalParams."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    damping: float = Field(0.2, ge=0, lt=1)
    actuator_gain: float = Field(0.1, ge=0, lt=1)
    mass: float = Field(0.2, ge=0, lt=1)
    obs_noise: float = Field(0.0, ge=0, description="Extra noise std sampled in [0, value].")


def apply_params(
    model: mujoco.MjModel, nominal: mujoco.MjModel, params: PhysicalParams, mass_mask: np.ndarray
) -> mujoco.MjModel:
    """Write ``params`` into ``model`` (same structure as ``nominal``) and return it.

    ``mass_mask`` (nbody,) selects the bodies whose mass and inertia ``params.mass`` scales.
    """
    scale = np.where(mass_mask, params.mass, 1.0)
    model.dof_damping[:] = nominal.dof_damping * params.damping
    model.actuator_gear[:, 0] = nominal.actuator_gear[:, 0] * params.actuator_gain
    model.body_mass[:] = nominal.body_mass * scale
    model.body_inertia[:] = nominal.body_inertia * scale[:, None]
    return model


def sample_params(centre: PhysicalParams, ranges: Randomization, rng: np.random.Generator) -> PhysicalParams:
    """Uniform sample around ``centre``: each scale times U(1-r, 1+r); noise adds U(0, r)."""
    scaled = {name: getattr(centre, name) * rng.uniform(1 - getattr(ranges, name), 1 + getattr(ranges, name)) for name in SCALED}
    noise = centre.obs_noise + rng.uniform(0.0, ranges.obs_noise)
    return centre.model_copy(update={**scaled, "obs_noise": noise})
