"""The reference robot: a STAND-IN for reality where no real robot exists.

It is the task's own MJCF with hidden physical parameters, latency and sensor noise
that the twin does not know. Everything it produces is labelled ``stand-in``. Its armature
stays at the datasheet (MJCF) value: with gain and damping, armature is only identifiable
through gravity or link inertia, which the planar reacher lacks (its 1 kg m² armature dwarfs
its links), so a hidden armature shift there would be fitted as a gain and damping shift.

Each profile shifts what calibration fits (damping, gain, mass, friction, latency) and says
what the robot reveals of it:

- cartpole: all are recovered.
- reacher: link mass hides behind the armature; calibration flags it unidentifiable.
- arm6: gravity loads every link and the wrist's armature dominates its small links' inertia, so
  gain, damping and the links' mass separate, and all four are recovered. Friction is 0.45 N m (3%
  of a wrist servo's 15 N m peak): at 0.3 N m it barely moved the replay error and fitted 40% low.
- quadruped: the legs' servo gain and damping and the torso payload are recovered. Leg friction
  is 0.08 N m, inside the training randomization U(0, 0.1): 0.3% of the servos' 25 N m peak. It
  is fitted within a few percent, but with a wide stated uncertainty (±45%): replays with foot
  contacts barely resolve it.

Besides these global-scale profiles, the ``per-joint`` profile makes every actuated joint differ: the
reacher's is the case of issue 33 (damping ×1.6 and ×0.7, gain ×0.95 and ×0.75, friction 0.02 and
0.06 N m); other tasks draw per-joint damping, gain and friction multipliers around their global
profile, and per-body masses where they have several mass bodies (arm6's links), seeded by the task name, so the
same every run. Its robot id is ``stand-in:<task>:per-joint``.
"""

from __future__ import annotations

import zlib

import numpy as np

from stages.sim.params import PhysicalParams, actuated_dofs, actuator_names

LABEL = "stand-in"
PROFILES = ("global", "per-joint")

_HIDDEN: dict[str, PhysicalParams] = {
    "cartpole": PhysicalParams(damping=1.6, actuator_gain=0.85, mass=1.25, friction=0.3, latency_steps=0, obs_noise=0.002),
    "reacher": PhysicalParams(damping=1.35, actuator_gain=0.88, mass=1.2, friction=2.0, latency_steps=1, obs_noise=0.002),
    "arm6": PhysicalParams(damping=1.25, actuator_gain=0.9, mass=1.15, friction=0.45, latency_steps=1, obs_noise=0.002),
    "quadruped": PhysicalParams(damping=1.25, actuator_gain=0.92, mass=1.15, friction=0.08, latency_steps=1,
                                obs_noise=0.002),
}


_PER_JOINT: dict[str, PhysicalParams] = {
    "reacher": PhysicalParams(latency_steps=1, obs_noise=0.002, damping_by_joint={"joint0": 1.6, "joint1": 0.7},
                              gain_by_actuator={"joint0": 0.95, "joint1": 0.75},
                              friction_by_joint={"joint0": 0.02, "joint1": 0.06}),
}


def hidden_params(task: str, profile: str = "global") -> PhysicalParams:
    """The stand-in's hidden truth for ``task`` (default: a generic 30% shift) under ``profile``."""
    base = _HIDDEN.get(task, PhysicalParams(damping=1.3, actuator_gain=0.9, mass=1.15, obs_noise=0.002))
    if profile == "global":
        return base
    if profile != "per-joint":
        raise ValueError(f"unknown stand-in profile {profile!r} (known: {', '.join(PROFILES)})")
    return _PER_JOINT[task] if task in _PER_JOINT else _drawn_per_joint(task, base)


def _drawn_per_joint(task: str, base: PhysicalParams) -> PhysicalParams:
    """Per-joint shifts around ``base``: damping ×U(0.6, 1.6), gain ×U(0.75, 1.05), friction ``base`` ×U(0.5, 1.5),
    and with several mass bodies each one's mass ×U(0.7, 1.3)."""
    from stages.sim.registry import load  # the registry imports the tasks, which import this module's users

    loaded = load(task)
    model, bodies = loaded.model, loaded.mass_bodies
    dofs = np.flatnonzero(actuated_dofs(model))
    joints = [str(model.joint(int(j)).name) for j in range(model.njnt) if model.jnt_dofadr[j] in dofs]
    rng = np.random.default_rng(zlib.crc32(task.encode()))
    draw = lambda names, low, high: {n: round(float(v), 3) for n, v in zip(names, rng.uniform(low, high, len(names)))}  # noqa: E731
    return base.model_copy(update={"damping_by_joint": draw(joints, 0.6, 1.6),
                                   "gain_by_actuator": draw(actuator_names(model), 0.75, 1.05),
                                   "friction_by_joint": draw(joints, 0.5 * base.friction, 1.5 * base.friction),
                                   "mass_by_body": draw(bodies, 0.7, 1.3) if len(bodies) > 1 else {}})


def robot_id(task: str, profile: str = "global") -> str:
    return f"{LABEL}:{task}" if profile == "global" else f"{LABEL}:{task}:{profile}"


def profile_of(robot: str) -> str | None:
    """The stand-in profile a robot id names (None: not a stand-in)."""
    if not robot.startswith(f"{LABEL}:"):
        return None
    parts = robot.split(":")
    return parts[2] if len(parts) > 2 else "global"
