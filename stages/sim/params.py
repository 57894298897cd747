"""Physical parameters of a robot model, and pure randomization around them.

Most parameters are multiplicative scales on the nominal MJCF values, so one set of names
fits every robot: ``damping`` (all joint damping), ``actuator_gain`` (every actuator's strength: a
motor's torque per unit control, a position servo's stiffness and damping, not its setpoint),
``armature`` (all joint armature: reflected rotor inertia), ``mass`` (the masses of the task's
``mass_bodies``: scaling every mass together with damping and gain would leave the dynamics
unchanged, so it is a payload-like scale). ``friction`` is absolute: Coulomb friction (MuJoCo
``frictionloss``, in joint units: N or N m) added on every actuated joint. Then ``latency_steps``
(action delay in control steps) and ``obs_noise`` (std of additive Gaussian observation noise).

Per element, optional values on top of those: multipliers ``damping_by_joint`` and ``armature_by_joint``
(keyed by MJCF joint name) and ``gain_by_actuator`` (keyed by actuator name, or for an unnamed actuator the
name of the joint it drives); ``friction_by_joint`` is absolute, like ``friction``, and replaces it on that
joint. Empty (the default) means every element takes the global value.
"""

from __future__ import annotations

import mujoco
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

SCALED = ("damping", "actuator_gain", "armature", "mass")


class PhysicalParams(BaseModel):
    """Scales on the nominal model plus latency and sensor noise."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    damping: float = Field(1.0, gt=0, description="Scale on every joint's damping.")
    actuator_gain: float = Field(1.0, gt=0, description="Scale on every actuator's gain (motor torque, servo kp and kv).")
    armature: float = Field(1.0, gt=0, description="Scale on every joint's armature.")
    mass: float = Field(1.0, gt=0, description="Scale on the mass of the task's mass bodies.")
    friction: float = Field(0.0, ge=0, description="Coulomb friction added on every actuated joint (N or N m).")
    latency_steps: int = Field(0, ge=0, description="Action delay in control steps.")
    obs_noise: float = Field(0.0, ge=0, description="Std of additive observation noise.")
    damping_by_joint: dict[str, float] = Field(default_factory=dict, description="Multiplier on ``damping`` per joint.")
    armature_by_joint: dict[str, float] = Field(default_factory=dict, description="Multiplier on ``armature`` per joint.")
    friction_by_joint: dict[str, float] = Field(default_factory=dict, description="Friction (N or N m) per actuated "
                                                "joint, in place of ``friction``.")
    gain_by_actuator: dict[str, float] = Field(default_factory=dict,
                                               description="Multiplier on ``actuator_gain`` per actuator.")


class Randomization(BaseModel):
    """Relative half-widths of uniform randomization around a centre PhysicalParams."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    damping: float = Field(0.2, ge=0, lt=1)
    actuator_gain: float = Field(0.1, ge=0, lt=1)
    armature: float = Field(0.0, ge=0, lt=1)
    mass: float = Field(0.2, ge=0, lt=1)
    friction: float = Field(0.0, ge=0, description="Extra friction sampled in [0, value] (joint units).")
    obs_noise: float = Field(0.0, ge=0, description="Extra noise std sampled in [0, value].")
    latency_steps: int = Field(0, ge=0, description="Extra action delay sampled uniformly in {0, …, value} control "
                                                    "steps, per environment.")


def actuated_dofs(model: mujoco.MjModel) -> np.ndarray:
    """(nv,) bool: the degrees of freedom an actuator drives through a joint."""
    mask = np.zeros(model.nv, dtype=bool)
    joints = model.actuator_trnid[model.actuator_trntype == mujoco.mjtTrn.mjTRN_JOINT, 0]
    mask[model.jnt_dofadr[joints]] = True
    return mask


def actuator_names(model: mujoco.MjModel) -> list[str]:
    """Each actuator's key in ``gain_by_actuator``: its MJCF name, or the name of the joint it drives."""
    names = []
    for a in range(model.nu):
        name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_ACTUATOR, a)
        if not name and model.actuator_trntype[a] == mujoco.mjtTrn.mjTRN_JOINT:
            name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, model.actuator_trnid[a, 0])
        names.append(name or f"actuator{a}")
    return names


_JOINT_DOFS = {int(mujoco.mjtJoint.mjJNT_FREE): 6, int(mujoco.mjtJoint.mjJNT_BALL): 3,
               int(mujoco.mjtJoint.mjJNT_SLIDE): 1, int(mujoco.mjtJoint.mjJNT_HINGE): 1}


def _per_dof(model: mujoco.MjModel, by_joint: dict[str, float], default: float = 1.0) -> np.ndarray:
    """(nv,) values from a per-joint-name dict (``default`` elsewhere)."""
    out = np.full(model.nv, default)
    for name, value in by_joint.items():
        j = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, name)
        if j < 0:
            raise KeyError(f"no joint named {name!r}")
        dof = model.jnt_dofadr[j]
        out[dof : dof + _JOINT_DOFS[int(model.jnt_type[j])]] = value
    return out


def _per_actuator(model: mujoco.MjModel, by_actuator: dict[str, float]) -> np.ndarray:
    """(nu,) multipliers from a per-actuator-name dict (1 elsewhere)."""
    out = np.ones(model.nu)
    if by_actuator:
        index = {name: a for a, name in enumerate(actuator_names(model))}
        for name, value in by_actuator.items():
            if name not in index:
                raise KeyError(f"no actuator named {name!r} (known: {sorted(index)})")
            out[index[name]] = value
    return out


def apply_params(
    model: mujoco.MjModel, nominal: mujoco.MjModel, params: PhysicalParams, mass_mask: np.ndarray,
    actuated: np.ndarray | None = None,
) -> mujoco.MjModel:
    """Write ``params`` into ``model`` (same structure as ``nominal``) and return it.

    ``mass_mask`` (nbody,) selects the bodies whose mass and inertia ``params.mass`` scales;
    ``actuated``: ``actuated_dofs(nominal)``, if the caller has it already.
    """
    scale = np.where(mass_mask, params.mass, 1.0)
    actuated = actuated_dofs(nominal) if actuated is None else actuated
    model.dof_damping[:] = nominal.dof_damping * params.damping * _per_dof(nominal, params.damping_by_joint)
    model.dof_armature[:] = nominal.dof_armature * params.armature * _per_dof(nominal, params.armature_by_joint)
    friction = _per_dof(nominal, params.friction_by_joint, params.friction)
    model.dof_frictionloss[:] = nominal.dof_frictionloss + np.where(actuated, friction, 0.0)
    # force = gain·ctrl + bias₁·length + bias₂·velocity: scaling gain and both bias terms scales a motor's
    # torque and a servo's kp and kv alike, and keeps a servo's setpoint where it was
    gain = params.actuator_gain * _per_actuator(nominal, params.gain_by_actuator)
    model.actuator_gainprm[:, 0] = nominal.actuator_gainprm[:, 0] * gain
    model.actuator_biasprm[:, 1:3] = nominal.actuator_biasprm[:, 1:3] * gain[:, None]
    model.body_mass[:] = nominal.body_mass * scale
    model.body_inertia[:] = nominal.body_inertia * scale[:, None]
    return model


def sample_params(centre: PhysicalParams, ranges: Randomization, rng: np.random.Generator) -> PhysicalParams:
    """Uniform sample around ``centre``: each scale times U(1-r, 1+r); noise and friction add U(0, r); latency adds
    an integer in {0, …, r}."""
    return sample_params_batch(centre, ranges, rng, 1)[0]


def sample_params_batch(centre: PhysicalParams, ranges: Randomization, rng: np.random.Generator,
                        n: int) -> list[PhysicalParams]:
    """``n`` samples as :func:`sample_params` draws them one after another (the same random stream), vectorized.

    A latency range adds one draw per sample (none without one, so other ranges keep their streams)."""
    k = len(SCALED)
    u = rng.random((n, k + 2 + (1 if ranges.latency_steps else 0)))
    half = np.array([getattr(ranges, name) for name in SCALED])
    scales = (1 - half) + ((1 + half) - (1 - half)) * u[:, :k]  # what rng.uniform(1-r, 1+r) computes
    values = np.array([getattr(centre, name) for name in SCALED]) * scales
    noise = centre.obs_noise + ranges.obs_noise * u[:, k]
    friction = centre.friction + ranges.friction * u[:, k + 1]
    latency = centre.latency_steps + (np.floor(u[:, k + 2] * (ranges.latency_steps + 1)).astype(int)
                                      if ranges.latency_steps else np.zeros(n, dtype=int))
    return [centre.model_copy(update={**dict(zip(SCALED, v.tolist())), "obs_noise": float(o), "friction": float(f),
                                      "latency_steps": int(lat)})
            for v, o, f, lat in zip(values, noise, friction, latency)]
