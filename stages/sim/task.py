"""What a task is: a robot MJCF plus its commands, observation, action, reward and termination terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import mujoco
import numpy as np

from stages.sim.params import PhysicalParams, Randomization

PRESETS = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class Term:
    """One named observation or action component, with its unit (and, for an action, optionally its joint)."""

    name: str
    unit: str
    joint: str = ""
    """For an action term: the MJCF joint its actuator drives; when given, registration checks it."""
    low: float = -np.inf
    high: float = np.inf
    """For an observation term: bounds its noise-free value always lies in (±inf where the task does not know)."""
    source: str = "measured"
    """For an observation term: ``measured`` (a sensor or joint reading of the robot) or ``command`` (given to the
    policy by the robot's software: a goal or a command; its name is one of the task's :class:`Command` names)."""
    noise: float = 0.0
    """For a measured observation term: std of this sensor's Gaussian noise (in ``unit``), on top of the
    environment's ``obs_noise``."""
    delay_steps: int = 0
    """For a measured observation term: this sensor's latency, in control steps (the value observed is the one of
    that many steps before)."""
    sensor: str = ""
    """For a measured observation term: the task's MJCF ``<sensor>`` whose reading it is, as read (the terms naming
    one sensor are its components, in order). Calibration can then put that sensor into its residual."""


@dataclass(frozen=True)
class Command:
    """A per-episode command or goal (a reach target, a velocity command): not part of the physics state, held by
    the environment beside it. Drawn by :meth:`Task.sample_commands` (uniform in [low, high] by default) at each
    reset and, when ``resample_steps`` > 0, again every that many control steps of the episode."""

    name: str
    unit: str
    low: float
    high: float
    resample_steps: int = 0


@dataclass(frozen=True)
class Metric:
    """A named per-episode measure of how well the task was done (a tracking error): :meth:`Task.step_metrics`
    gives its value at each control step, evaluation averages it over each episode's steps, and a gate may bound
    it (a ceiling when lower is better, a floor when higher is)."""

    name: str
    unit: str
    better: Literal["lower", "higher"] = "lower"


@dataclass(frozen=True)
class Task:
    """Base class of every task. Subclasses set the fields and implement the vectorized terms.

    Shapes: ``qpos`` (N, nq), ``qvel`` (N, nv), ``action`` (N, nu) in [-1, 1]. A task with
    ``action_history`` also gets ``last_action`` (N, nu) in ``observe`` and ``reward``; a task with
    ``commands`` gets ``command`` (N, len(commands)) in ``observe``, ``reward``, ``terminated`` and ``succeeded``.
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
    start_smoothing: int = 1
    """Calibration's default Savitzky-Golay window over the logged states a replay starts from (1: raw). Contact-rich
    robots want 5: sensor noise in body height moves their contacts and biases the fit (``stages.twin.replay``);
    fast joints want 1: a quadratic over 5 samples misses their velocity changes."""
    joint_window: int | None = None
    """Calibration's default replay window of the per-joint pass (control steps; None: the global fit's window)."""
    fit_starts: bool = False
    """Calibration fits the per-joint windows' start states with the parameters by default (``stages.twin.starts``):
    for small joint frictions, which show in long windows, at the cost of the start fits (the reacher's: 46-step
    windows, 0.02 N m recovered within 3.5% where the logged starts left it 42% off)."""
    excitation_scale: float = 1.0
    """Std of the stand-in's random excitation before its ±1 clip, in normalized action units
    (``collect.rollouts.excitation``): below 1 it keeps actuators off their force limits, where a gain does not act,
    so calibration can identify the gains."""
    action_history: bool = False
    """``observe(qpos, qvel, last_action)`` gets the policy action just applied and ``reward(qpos, qvel, action,
    last_action)`` the one before it (zeros after a reset); the environment keeps them."""
    commands: tuple[Command, ...] = ()
    """Episode commands/goals; when declared, ``observe``, ``reward``, ``terminated`` and ``succeeded`` get them as
    ``command`` (N, len(commands)), in this order."""
    mocap_body: str = ""
    """A mocap body of the MJCF that follows three commands (``mocap_commands``, world x, y, z in m): the goal made
    visible in renders, without being in ``qpos``."""
    mocap_commands: tuple[str, ...] = ()
    sensors: tuple[str, ...] = ()
    """Names of the MJCF's ``<sensor>`` elements the terms read: ``observe``, ``reward``, ``terminated`` and
    ``succeeded`` then get ``sensor`` ({name: (N, dim)}), the readings MuJoCo computed in the control period's last
    physics step (as a sensor sampled just before the control tick)."""
    privileged: tuple[Term, ...] = ()
    """Simulator-only observation terms (``observe_privileged``): the critic sees them besides ``observations``; the
    actor, its export and the bundle never do."""
    metrics: tuple[Metric, ...] = ()
    """Per-episode metrics evaluation reports and gates may bound; ``step_metrics`` computes them."""
    preset: Path | None = None
    """A run configuration (YAML, the keys of ``sim2edge run --config``) with this task's training settings; default:
    ``stages/sim/presets/<name>.yaml`` when there is one."""

    @property
    def preset_path(self) -> Path | None:
        """This task's preset file, if it has one."""
        builtin = PRESETS / f"{self.name}.yaml"
        return self.preset if self.preset is not None else (builtin if builtin.is_file() else None)

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
    def sensor_terms(self) -> dict[str, np.ndarray]:
        """Per sensor read verbatim by observation terms (``Term.sensor``): the indices of those terms, in order."""
        out: dict[str, list[int]] = {}
        for i, t in enumerate(self.observations):
            if t.sensor:
                out.setdefault(t.sensor, []).append(i)
        for name, terms in out.items():
            where = self.sensor_slices.get(name)
            if where is None:
                raise ValueError(f"task {self.name!r}: observation term {self.observations[terms[0]].name!r} reads "
                                 f"sensor {name!r}, which is not in the task's sensors {list(self.sensors)}")
            if len(terms) != where.stop - where.start or any(self.observations[i].source != "measured" for i in terms):
                raise ValueError(f"task {self.name!r}: sensor {name!r} has {where.stop - where.start} components but "
                                 f"{len(terms)} measured observation terms read it")
        return {name: np.array(terms) for name, terms in out.items()}

    def unread_sensors(self, names) -> list[str]:
        """The names among ``names`` that no observation term reads verbatim (``Term.sensor``), each as one line."""
        known = self.sensor_terms
        return [f"task {self.name!r} has no observation terms that read sensor {n!r} (Term.sensor); these do: "
                f"{sorted(known) or 'none'}" for n in names if n not in known]

    @cached_property
    def mocap(self) -> tuple[int, np.ndarray] | None:
        """(mocap index of ``mocap_body``, indices of its three commands), or None without one."""
        if not self.mocap_body:
            return None
        body = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, self.mocap_body)
        if body < 0 or self.model.body_mocapid[body] < 0:
            raise ValueError(f"task {self.name!r}: mocap_body {self.mocap_body!r} is not a mocap body of {self.mjcf.name}")
        names = [c.name for c in self.commands]
        if len(self.mocap_commands) != 3 or any(c not in names for c in self.mocap_commands):
            raise ValueError(f"task {self.name!r}: mocap_commands {self.mocap_commands!r} must name three of the "
                             f"commands {names}")
        return int(self.model.body_mocapid[body]), np.array([names.index(c) for c in self.mocap_commands])

    @cached_property
    def sensor_slices(self) -> dict[str, slice]:
        """Where each of ``sensors`` lies in ``sensordata``."""
        m, out = self.model, {}
        for name in self.sensors:
            i = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SENSOR, name)
            if i < 0:
                have = [m.sensor(k).name for k in range(m.nsensor)]
                raise ValueError(f"task {self.name!r}: sensor {name!r} is not in {self.mjcf.name} (sensors: {have})")
            out[name] = slice(int(m.sensor_adr[i]), int(m.sensor_adr[i] + m.sensor_dim[i]))
        return out

    def readings(self, sensordata: np.ndarray) -> dict[str, np.ndarray]:
        """``sensordata`` (N, nsensordata) as {sensor name: (N, dim)}."""
        return {name: sensordata[:, where] for name, where in self.sensor_slices.items()}

    def sensordata_at(self, qpos: np.ndarray, qvel: np.ndarray) -> np.ndarray:
        """(N, nsensordata) the nominal model's sensor readings at these states (``mj_forward``), e.g. after a reset."""
        m = self.model
        data, out = mujoco.MjData(m), np.zeros((len(qpos), m.nsensordata))
        for i, (q, v) in enumerate(zip(qpos, qvel)):
            data.qpos[:], data.qvel[:] = q, v
            mujoco.mj_forward(m, data)
            out[i] = data.sensordata
        return out

    def edit(self, spec: mujoco.MjSpec) -> None:
        """Additions to a robot model the task does not own — a mocap goal body, sites, ``<sensor>`` elements —
        made on its parsed ``MjSpec``, so the MJCF file stays exactly as its package ships it. Default: none."""

    def spec(self) -> mujoco.MjSpec:
        """The robot's model as this task uses it: ``mjcf`` parsed, then :meth:`edit` applied."""
        spec = mujoco.MjSpec.from_file(str(self.mjcf))
        self.edit(spec)
        return spec

    @cached_property
    def model(self) -> mujoco.MjModel:
        """The nominal MuJoCo model (compiled once from :meth:`spec`)."""
        return self.spec().compile()

    @cached_property
    def reference_qpos(self) -> np.ndarray:
        """(nq,) the robot's reference pose, around which ``Disturbance.init_spread`` scales the initial state."""
        return self.model.qpos0.copy()

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

    def observation_offsets(self) -> np.ndarray:
        """(obs_dim,) what ``observe`` subtracts from each measured quantity (e.g. a standing pose); zeros here."""
        return np.zeros(self.obs_dim, np.float32)

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

    def succeeded(self, qpos: np.ndarray, qvel: np.ndarray, **inputs: np.ndarray) -> np.ndarray:
        """(N,) bool: whether the final state of an episode counts as success (default: always)."""
        return np.ones(len(qpos), dtype=bool)

    def step_metrics(self, qpos: np.ndarray, qvel: np.ndarray, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        """{name: (N,)} each of ``metrics`` at the state after a control step; the same keyword inputs as
        ``terminated`` (default: none)."""
        return {}

    def history(self, n: int) -> dict[str, np.ndarray]:
        """Keyword arguments of ``observe`` and ``reward`` besides the state: ``last_action`` zeros for ``n`` envs."""
        return {"last_action": np.zeros((n, self.act_dim), dtype=np.float32)} if self.action_history else {}

    def sample_commands(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n, len(commands)) fresh commands: uniform in each command's [low, high]. Override for goals that must
        be reachable; values must stay within [low, high]."""
        low, high = np.array([[c.low, c.high] for c in self.commands]).reshape(-1, 2).T
        return rng.uniform(low, high, (n, len(self.commands))).astype(np.float32)

    def command_args(self, command: np.ndarray) -> dict[str, np.ndarray]:
        """``{"command": command}`` for a task with commands, else nothing (its terms take no such argument)."""
        return {"command": command} if self.commands else {}

    def sensor_args(self, sensordata: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
        """``{"sensor": {name: reading}}`` for a task that reads sensors, else nothing."""
        return {"sensor": self.readings(sensordata)} if self.sensors else {}

    def observe_privileged(self, qpos: np.ndarray, qvel: np.ndarray, **inputs: np.ndarray) -> np.ndarray:
        """(N, len(privileged)) the simulator-only terms for the critic; the same keyword inputs as ``observe``."""
        raise NotImplementedError

    def validate(self) -> None:
        """Fail at registration with the offending term named (:mod:`stages.sim.task_checks`)."""
        from stages.sim.task_checks import validate

        validate(self)
