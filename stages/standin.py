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
"""

from __future__ import annotations

from stages.sim.params import PhysicalParams

LABEL = "stand-in"

_HIDDEN: dict[str, PhysicalParams] = {
    "cartpole": PhysicalParams(damping=1.6, actuator_gain=0.85, mass=1.25, friction=0.3, latency_steps=0, obs_noise=0.002),
    "reacher": PhysicalParams(damping=1.35, actuator_gain=0.88, mass=1.2, friction=2.0, latency_steps=1, obs_noise=0.002),
    "arm6": PhysicalParams(damping=1.25, actuator_gain=0.9, mass=1.15, friction=0.45, latency_steps=1, obs_noise=0.002),
    "quadruped": PhysicalParams(damping=1.25, actuator_gain=0.92, mass=1.15, friction=0.08, latency_steps=1,
                                obs_noise=0.002),
}


def hidden_params(task: str) -> PhysicalParams:
    """The stand-in's hidden truth for ``task`` (default: a generic 30% shift)."""
    return _HIDDEN.get(task, PhysicalParams(damping=1.3, actuator_gain=0.9, mass=1.15, obs_noise=0.002))


def robot_id(task: str) -> str:
    return f"{LABEL}:{task}"
