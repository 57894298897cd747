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
(keyed by MJCF joint name), ``gain_by_actuator`` (keyed by actuator name, or for an unnamed actuator the
name of the joint it drives) and ``kv_by_actuator`` (a position servo's velocity gain, on top of its gain);
``friction_by_joint`` is absolute, like ``friction``, and replaces it on that
joint; ``mass_by_body`` multiplies a body's mass and inertia together (keyed by body name, on top of ``mass`` for the
mass bodies): the same factor on both keeps the body's density uniform, so its inertia stays physically consistent.
Empty (the default) means every element takes the global value.
"""

from __future__ import annotations

import mujoco
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SCALED = ("damping", "actuator_gain", "armature", "mass")
PER_ELEMENT = ("damping_by_joint", "armature_by_joint", "gain_by_actuator", "kv_by_actuator", "friction_by_joint",
               "mass_by_body")
MAX_SPREAD = 2.0
"""A twin's interval of a scale or multiplier is cut at ×/÷ this around the fitted value: an unidentifiable one spans
the whole search range [0.2, 5], and a policy trained across a 25× range of gains learns a timid compromise."""

Range = tuple[float, float]


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
    kv_by_actuator: dict[str, float] = Field(default_factory=dict, description="Multiplier on a position servo's "
                                             "velocity gain (kv) per actuator, on top of its gain: kv apart from kp.")
    mass_by_body: dict[str, float] = Field(default_factory=dict, description="Multiplier on mass and inertia per body "
                                           "(on top of ``mass`` for the mass bodies).")


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
    ranges: dict[str, Range] = Field(default_factory=dict, description="Absolute uniform range per parameter, in "
                                     "place of its half-width: a global one by name (a scale or ``friction``), a "
                                     "per-element one as ``<field>.<joint or actuator>`` (e.g. "
                                     "``damping_by_joint.hip``).")

    @model_validator(mode="after")
    def _known_ranges(self) -> Randomization:
        for key, (lo, hi) in self.ranges.items():
            field, _, name = key.partition(".")
            if not (field in (*SCALED, "friction") and not name or field in PER_ELEMENT and name):
                raise ValueError(f"no randomizable parameter {key!r}")
            if not 0 <= lo <= hi or lo == 0 and field not in ("friction", "friction_by_joint"):
                raise ValueError(f"range {key!r} must satisfy 0 < lo <= hi (friction: 0 <= lo): {(lo, hi)}")
        return self

    def around(self, centre: PhysicalParams, intervals: dict[str, Range]) -> Randomization:
        """These ranges widened to a twin's ``intervals`` (keyed as :attr:`ranges`; empty: ``self`` unchanged).

        Per parameter, the range is the union of the task's own (a scale: ``centre`` × (1 ± half-width); friction:
        ``centre`` + [0, ``friction``]; a per-element multiplier: its fitted value alone) and the twin's interval,
        a scale's or multiplier's cut at ×/÷ :data:`MAX_SPREAD` around the fitted value. Friction intervals are taken
        whole: calibration's search already bounds them (a fraction of the largest actuator effort)."""
        return self.model_validate({**self.model_dump(), "ranges": {**self.ranges, **{
            key: _widened(key, _fitted(centre, key), self, interval) for key, interval in intervals.items()}}})


def _fitted(centre: PhysicalParams, key: str) -> float:
    """The value of ``key`` (a name or ``<field>.<element>``) in ``centre``: a multiplier defaults to 1, a per-joint
    friction to the global one."""
    field, _, name = key.partition(".")
    if not name:
        return getattr(centre, field)
    return getattr(centre, field).get(name, centre.friction if field == "friction_by_joint" else 1.0)


def _widened(key: str, value: float, task: Randomization, interval: Range) -> Range:
    """The union of the task's range of ``key`` around ``value`` and the twin's ``interval`` (see
    :meth:`Randomization.around`)."""
    field = key.partition(".")[0]
    if field in ("friction", "friction_by_joint"):
        return min(value, interval[0]), max(value + task.friction, interval[1])
    half = getattr(task, field) if field in SCALED else 0.0
    lo, hi = max(interval[0], value / MAX_SPREAD), min(interval[1], value * MAX_SPREAD)
    return min(value * (1 - half), lo), max(value * (1 + half), hi)


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


def _per_body(model: mujoco.MjModel, by_body: dict[str, float]) -> np.ndarray:
    """(nbody,) multipliers from a per-body-name dict (1 elsewhere)."""
    out = np.ones(model.nbody)
    for name, value in by_body.items():
        b = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, name)
        if b <= 0:
            raise KeyError(f"no body named {name!r}")
        out[b] = value
    return out


def apply_params(
    model: mujoco.MjModel, nominal: mujoco.MjModel, params: PhysicalParams, mass_mask: np.ndarray,
    actuated: np.ndarray | None = None, scratch: mujoco.MjData | None = None,
) -> mujoco.MjModel:
    """Write ``params`` into ``model`` (same structure as ``nominal``) and return it.

    ``mass_mask`` (nbody,) selects the bodies whose mass and inertia ``params.mass`` scales (``mass_by_body`` then
    multiplies per body);
    ``actuated``: ``actuated_dofs(nominal)``, if the caller has it already. Then ``mj_setConst`` recomputes the
    constants that mass and armature enter (constraint softness, subtree masses), as compiling ``twin.xml`` does;
    ``scratch``: an MjData of this structure for it to work in (a fresh one costs milliseconds).
    """
    scale = np.where(mass_mask, params.mass, 1.0) * _per_body(nominal, params.mass_by_body)
    actuated = actuated_dofs(nominal) if actuated is None else actuated
    model.dof_damping[:] = nominal.dof_damping * params.damping * _per_dof(nominal, params.damping_by_joint)
    model.dof_armature[:] = nominal.dof_armature * params.armature * _per_dof(nominal, params.armature_by_joint)
    friction = _per_dof(nominal, params.friction_by_joint, params.friction)
    model.dof_frictionloss[:] = nominal.dof_frictionloss + np.where(actuated, friction, 0.0)
    # force = gain·ctrl + bias₁·length + bias₂·velocity: scaling gain and both bias terms scales a motor's
    # torque and a servo's kp and kv alike, and keeps a servo's setpoint where it was; kv_by_actuator then moves kv
    gain = params.actuator_gain * _per_actuator(nominal, params.gain_by_actuator)
    model.actuator_gainprm[:, 0] = nominal.actuator_gainprm[:, 0] * gain
    model.actuator_biasprm[:, 1] = nominal.actuator_biasprm[:, 1] * gain
    model.actuator_biasprm[:, 2] = nominal.actuator_biasprm[:, 2] * gain * _per_actuator(nominal, params.kv_by_actuator)
    model.body_mass[:] = nominal.body_mass * scale
    model.body_inertia[:] = nominal.body_inertia * scale[:, None]
    mujoco.mj_setConst(model, mujoco.MjData(model) if scratch is None else scratch)
    return model


def sample_params(centre: PhysicalParams, ranges: Randomization, rng: np.random.Generator) -> PhysicalParams:
    """Uniform sample around ``centre``: each scale times U(1-r, 1+r); noise and friction add U(0, r); latency adds
    an integer in {0, …, r}; a parameter in ``ranges.ranges`` is U(lo, hi) instead."""
    return sample_params_batch(centre, ranges, rng, 1)[0]


def sample_params_batch(centre: PhysicalParams, ranges: Randomization, rng: np.random.Generator,
                        n: int) -> list[PhysicalParams]:
    """``n`` samples as :func:`sample_params` draws them one after another (the same random stream), vectorized.

    A latency range adds one draw per sample, and so does each per-element range, after all others (none without
    them, so other ranges keep their streams)."""
    k, latency_draws = len(SCALED), 1 if ranges.latency_steps else 0
    elements = [key for key in ranges.ranges if "." in key]
    u = rng.random((n, k + 2 + latency_draws + len(elements)))
    half = np.array([getattr(ranges, name) for name in SCALED])
    scales = (1 - half) + ((1 + half) - (1 - half)) * u[:, :k]  # what rng.uniform(1-r, 1+r) computes
    values = np.array([getattr(centre, name) for name in SCALED]) * scales
    for i, name in enumerate(SCALED):
        if name in ranges.ranges:
            values[:, i] = _uniform(ranges.ranges[name], u[:, i])
    noise = centre.obs_noise + ranges.obs_noise * u[:, k]
    friction = (_uniform(ranges.ranges["friction"], u[:, k + 1]) if "friction" in ranges.ranges
                else centre.friction + ranges.friction * u[:, k + 1])
    latency = centre.latency_steps + (np.floor(u[:, k + 2] * (ranges.latency_steps + 1)).astype(int)
                                      if ranges.latency_steps else np.zeros(n, dtype=int))
    per_element = _uniform(np.array([ranges.ranges[key] for key in elements]).reshape(-1, 2).T,
                           u[:, k + 2 + latency_draws :])
    return [centre.model_copy(update={**dict(zip(SCALED, v.tolist())), "obs_noise": float(o), "friction": float(f),
                                      "latency_steps": int(lat), **_by_element(centre, elements, e)})
            for v, o, f, lat, e in zip(values, noise, friction, latency, per_element)]


def _uniform(bounds: Range | np.ndarray, u: np.ndarray) -> np.ndarray:
    """U(lo, hi) from uniform draws ``u`` in [0, 1), as ``rng.uniform`` computes it (``bounds`` broadcast)."""
    lo, hi = bounds
    return lo + (hi - lo) * u


def _by_element(centre: PhysicalParams, keys: list[str], values: np.ndarray) -> dict[str, dict[str, float]]:
    """``centre``'s per-element dicts with ``values`` at ``keys`` (``<field>.<element>``); only the fields touched."""
    out: dict[str, dict[str, float]] = {}
    for key, value in zip(keys, values.tolist()):
        field, _, name = key.partition(".")
        out.setdefault(field, dict(getattr(centre, field)))[name] = value
    return out
