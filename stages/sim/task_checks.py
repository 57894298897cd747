"""The checks a task passes when it is loaded: terms, actuators, commands, a finite model, shapes and finite values at
its initial states. Each failure is one line naming the task and the offending term."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mujoco
import numpy as np

if TYPE_CHECKING:
    from stages.sim.task import Task, Term


def validate(task: Task) -> None:
    """Fail at registration with the offending term named."""
    m = task.model
    for kind, terms in (("observation", task.observations), ("action", task.actions)):
        if not terms:
            raise ValueError(f"task {task.name!r}: no {kind} terms")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"task {task.name!r}: {kind} term {next(n for n in names if names.count(n) > 1)!r} repeats")
    if task.decimation < 1 or task.episode_steps < 1:
        raise ValueError(f"task {task.name!r}: decimation ({task.decimation}) and episode_steps "
                         f"({task.episode_steps}) must be at least 1")
    if m.nu != task.act_dim:
        raise ValueError(f"task {task.name!r}: {task.act_dim} action terms but the MJCF has {m.nu} actuators")
    for a, term in enumerate(task.actions):
        if not m.actuator_ctrllimited[a]:
            raise ValueError(f"task {task.name!r}: action term {term.name!r}: its actuator needs a ctrlrange")
        if term.joint:
            check_actuated(task, a, term)
    check_finite_model(task)
    check_commands(task)
    task.mass_mask  # noqa: B018 - resolves the body names
    task.replayed_qpos  # noqa: B018 - resolves the joint names
    check_terms(task)


def check_actuated(task: Task, a: int, term: Term) -> None:
    """Action term ``a`` names the joint that actuator ``a`` drives."""
    m = task.model
    joint = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, term.joint)
    if joint < 0:
        raise ValueError(f"task {task.name!r}: action term {term.name!r}: joint {term.joint!r} is not in {task.mjcf.name}")
    driven = m.actuator_trnid[m.actuator_trntype == mujoco.mjtTrn.mjTRN_JOINT, 0]
    if joint not in driven:
        raise ValueError(f"task {task.name!r}: action term {term.name!r}: joint {term.joint!r} has no actuator")
    if m.actuator_trntype[a] != mujoco.mjtTrn.mjTRN_JOINT or m.actuator_trnid[a, 0] != joint:
        raise ValueError(f"task {task.name!r}: action term {term.name!r} is number {a}, but actuator {a} does not "
                         f"drive joint {term.joint!r} (action terms follow actuator order)")


def check_commands(task: Task) -> None:
    """Commands are named once with a finite range; every ``command`` observation term names one."""
    names = [c.name for c in task.commands]
    for c in task.commands:
        if names.count(c.name) > 1:
            raise ValueError(f"task {task.name!r}: command {c.name!r} repeats")
        if not (np.isfinite(c.low) and np.isfinite(c.high) and c.low <= c.high) or c.resample_steps < 0:
            raise ValueError(f"task {task.name!r}: command {c.name!r} needs a finite range low <= high and "
                             f"resample_steps >= 0 (got [{c.low}, {c.high}], {c.resample_steps})")
    for t in task.observations:
        if t.noise < 0 or t.delay_steps < 0 or ((t.noise or t.delay_steps) and t.source != "measured"):
            raise ValueError(f"task {task.name!r}: observation term {t.name!r}: noise ({t.noise}) and delay_steps "
                             f"({t.delay_steps}) must be >= 0, and only a measured term has them")
        if t.source not in ("measured", "command"):
            raise ValueError(f"task {task.name!r}: observation term {t.name!r}: source {t.source!r} is not "
                             f"'measured' or 'command'")
        if t.source == "command" and t.name not in names:
            raise ValueError(f"task {task.name!r}: observation term {t.name!r} is a command but the task "
                             f"declares no command of that name (commands: {names})")
    task.mocap  # noqa: B018 - resolves the mocap body and its commands
    task.sensor_slices  # noqa: B018 - resolves the sensor names
    task.sensor_terms  # noqa: B018 - matches terms to sensors
    clash = {t.name for t in task.observations} & {t.name for t in task.privileged}
    if clash:
        raise ValueError(f"task {task.name!r}: term {sorted(clash)[0]!r} is both an observation and privileged")


def check_finite_model(task: Task) -> None:
    """No NaN/Inf in the physical quantities of the MJCF (names the field and the element)."""
    m = task.model
    fields = {"body_mass": mujoco.mjtObj.mjOBJ_BODY, "body_inertia": mujoco.mjtObj.mjOBJ_BODY,
              "body_pos": mujoco.mjtObj.mjOBJ_BODY, "dof_damping": None, "dof_armature": None,
              "jnt_range": mujoco.mjtObj.mjOBJ_JOINT, "geom_size": mujoco.mjtObj.mjOBJ_GEOM,
              "actuator_gear": mujoco.mjtObj.mjOBJ_ACTUATOR, "actuator_gainprm": mujoco.mjtObj.mjOBJ_ACTUATOR,
              "actuator_biasprm": mujoco.mjtObj.mjOBJ_ACTUATOR, "actuator_ctrlrange": mujoco.mjtObj.mjOBJ_ACTUATOR,
              "qpos0": None}
    for name, obj in fields.items():
        values = np.asarray(getattr(m, name)).reshape(len(getattr(m, name)), -1)
        bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
        if len(bad):
            element = (mujoco.mj_id2name(m, obj, int(bad[0])) if obj is not None else None) or f"#{bad[0]}"
            raise ValueError(f"task {task.name!r}: {task.mjcf.name} has NaN/Inf in {name} of {element}")
    if not np.isfinite(m.opt.timestep) or m.opt.timestep <= 0:
        raise ValueError(f"task {task.name!r}: {task.mjcf.name} has timestep {m.opt.timestep}")


def check_terms(task: Task) -> None:
    """The vectorized terms give the declared shapes and finite values at initial states."""
    m, n = task.model, 2
    qpos, qvel = task.initial_state(np.random.default_rng(0), n)
    for name, value, shape in (("initial_state qpos", qpos, (n, m.nq)), ("initial_state qvel", qvel, (n, m.nv))):
        if np.shape(value) != shape:
            raise ValueError(f"task {task.name!r}: {name} has shape {np.shape(value)}, expected {shape} (N, "
                             f"{'nq' if 'qpos' in name else 'nv'})")
    rng = np.random.default_rng(0)
    command = task.sample_commands(rng, n)
    if task.commands:
        low, high = np.array([c.low for c in task.commands]), np.array([c.high for c in task.commands])
        if np.shape(command) != (n, len(task.commands)) or not ((command >= low) & (command <= high)).all():
            raise ValueError(f"task {task.name!r}: sample_commands() gave shape {np.shape(command)} or values "
                             f"outside the commands' ranges; expected (N, {len(task.commands)}) within them")
    inputs = {**task.command_args(command), **task.sensor_args(task.sensordata_at(qpos, qvel))}
    history = {**task.history(n), **inputs}
    obs = task.observe(qpos, qvel, **history)
    if np.shape(obs) != (n, task.obs_dim):
        raise ValueError(f"task {task.name!r}: observe() gave shape {np.shape(obs)}, expected (N, {task.obs_dim}) "
                         f"for the observation terms {', '.join(t.name for t in task.observations)}")
    if not np.all(np.isfinite(obs)):
        term = task.observations[int(np.flatnonzero(~np.isfinite(obs).all(axis=0))[0])].name
        raise ValueError(f"task {task.name!r}: observe() gave NaN/Inf in observation term {term!r} at the initial state")
    low, high = np.array([t.low for t in task.observations]), np.array([t.high for t in task.observations])
    if (outside := ~((obs >= low) & (obs <= high)).all(axis=0)).any():
        t = task.observations[int(np.flatnonzero(outside)[0])]
        raise ValueError(f"task {task.name!r}: observe() gave observation term {t.name!r} outside its bounds "
                         f"[{t.low}, {t.high}] at the initial state")
    readings = inputs.get("sensor", {})
    for name, terms in task.sensor_terms.items():
        if not np.allclose(obs[:, terms], readings[name], rtol=1e-4, atol=1e-5):
            raise ValueError(f"task {task.name!r}: observation terms {[task.observations[i].name for i in terms]} "
                             f"say they read sensor {name!r}, but observe() gives other values at the initial state")
    reward = task.reward(qpos, qvel, np.zeros((n, task.act_dim), dtype=np.float32), **history)
    if np.shape(reward) != (n,):
        raise ValueError(f"task {task.name!r}: reward() gave shape {np.shape(reward)}, expected (N,)")
    if not np.all(np.isfinite(reward)):
        raise ValueError(f"task {task.name!r}: reward() gave NaN/Inf at the initial state")
    if task.privileged:
        extra = task.observe_privileged(qpos, qvel, **history)
        if np.shape(extra) != (n, len(task.privileged)) or not np.all(np.isfinite(extra)):
            raise ValueError(f"task {task.name!r}: observe_privileged() gave shape {np.shape(extra)} or NaN/Inf, "
                             f"expected finite (N, {len(task.privileged)}) for {[t.name for t in task.privileged]}")
    for name in ("terminated", "succeeded"):
        done = getattr(task, name)(qpos, qvel, **inputs)
        if np.shape(done) != (n,) or np.asarray(done).dtype != bool:
            raise ValueError(f"task {task.name!r}: {name}() gave shape {np.shape(done)} dtype "
                             f"{np.asarray(done).dtype}, expected (N,) bool")
    check_metrics(task, task.step_metrics(qpos, qvel, **inputs), n)


def check_metrics(task: Task, values: dict[str, np.ndarray], n: int) -> None:
    """Metrics are named once, lower or higher is better, and ``step_metrics`` gives each finite (N,)."""
    names = [m.name for m in task.metrics]
    for m in task.metrics:
        if names.count(m.name) > 1 or m.better not in ("lower", "higher"):
            raise ValueError(f"task {task.name!r}: metric {m.name!r} repeats or its better ({m.better!r}) is "
                             f"not 'lower' or 'higher'")
    if sorted(values) != sorted(names):
        raise ValueError(f"task {task.name!r}: step_metrics() gave {sorted(values)}, expected the metrics {names}")
    for name, v in values.items():
        if np.shape(v) != (n,) or not np.all(np.isfinite(v)):
            raise ValueError(f"task {task.name!r}: step_metrics() gave metric {name!r} shape {np.shape(v)} or "
                             f"NaN/Inf, expected finite (N,) at the initial state")
