"""The reference robot: a STAND-IN for reality where no real robot exists.

It is the task's own MJCF with hidden physical parameters, latency and sensor noise
that the twin does not know. Everything it produces is labelled ``stand-in``. Its armature
stays at the datasheet (MJCF) value: with gain and damping, armature is only identifiable
through gravity or link inertia, which the planar reacher lacks (its 1 kg m² armature dwarfs
its links), so a hidden armature shift there would be fitted as a gain and damping shift.
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
