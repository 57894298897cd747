"""``mujoco.sysid`` as the reference for sim2edge's calibration (issue 33), on the windows sim2edge calibrated on.

Each replay window (start state, the logged controls at sim2edge's fitted latency, held per physics step, and the
logged joint positions at the control steps) becomes one ``mujoco.sysid`` sequence; the parameters are written into
the task's ``MjSpec`` by modifiers (damping and gain as scales on the nominal values, friction in N m on the actuated
joints, mass as a scale on the task's mass bodies' explicit inertials); the residual is the plain difference of
replayed and logged positions at the control steps (sysid's default residual resamples controls linearly and
normalizes each window by its positions' norm). ``sysid.optimize`` (MuJoCo's least squares) fits them from the
nominal model, and ``sysid.calculate_intervals`` gives its 95% intervals, each one alone; they are widened here to
hold together at 95% as sim2edge's do (× ``intervals.quantile`` (d) / 1.96 for d parameters), so both sides state the
same confidence. sysid has no integer latency search: it replays at the latency sim2edge found. Called by
``benchmarks/calibrate_reacher.py --sysid``.
"""

from __future__ import annotations

import contextlib
import io
import time

import mujoco
import numpy as np
from absl import logging
from mujoco import sysid

from stages.artifacts import TwinSpec
from stages.sim.params import PhysicalParams, actuated_dofs, actuator_names
from stages.sim.task import Task
from stages.twin.intervals import Z, quantile
from stages.twin.replay import Replayer
from stages.twin.search import FRICTION_RANGE, max_effort

Q = sysid.SignalType.MjStateQPos


def actuated_joints(m: mujoco.MjModel) -> list[str]:
    """Names of the joints an actuator drives."""
    return [str(m.joint(j).name) for j in range(m.njnt) if actuated_dofs(m)[m.jnt_dofadr[j]]]


def parameters(task: Task, profile: str) -> sysid.ParameterDict:
    """The fitted parameters as sysid spec modifiers, named as in the table; each starts at the nominal model
    (friction at 1% of the max effort, as sim2edge's search does)."""
    m, params = task.model, sysid.ParameterDict()
    joints, actuated = [str(m.joint(j).name) for j in range(m.njnt)], actuated_joints(m)
    friction_max = FRICTION_RANGE * max_effort(task)

    def scale(name: str, write) -> None:
        params.add(sysid.Parameter(name, 1.0, 0.2, 5.0, modifier=lambda spec, p: write(spec, p.value[0])))

    def dof(j: str) -> int:
        return m.jnt_dofadr[m.joint(j).id]

    def damping(names):
        def write(spec, s):
            for j in names:
                spec.joint(j).damping[0] = m.dof_damping[dof(j)] * s
        return write

    def gain(indices):
        def write(spec, s):
            for a in indices:
                spec.actuators[a].gainprm[0] = m.actuator_gainprm[a, 0] * s
                spec.actuators[a].biasprm[1:3] = m.actuator_biasprm[a, 1:3] * s
        return write

    def friction(name: str, names) -> None:
        def write(spec, p):
            for j in names:
                spec.joint(j).frictionloss = m.dof_frictionloss[dof(j)] + p.value[0]
        params.add(sysid.Parameter(name, 0.05 * friction_max, 0.0, friction_max, modifier=write))

    if profile == "global":
        scale("damping", damping(joints))
        scale("actuator_gain", gain(range(m.nu)))
        scale("mass", mass(task))
        friction("friction", actuated)
    else:
        drives = dict(zip(actuator_names(m), (str(m.joint(j).name) for j in m.actuator_trnid[:, 0])))
        for j in actuated:
            scale(f"damping.{j}", damping([j]))
        for j in actuated:
            scale(f"gain.{j}", gain([a for a, name in enumerate(drives) if drives[name] == j]))
        for j in actuated:
            friction(f"friction.{j}", [j])
    return params


def mass(task: Task):
    """A modifier scaling the mass and inertia of the task's mass bodies, as explicit inertials."""
    m = task.model
    bodies = np.flatnonzero(task.mass_mask)

    def write(spec: mujoco.MjSpec, s: float) -> None:
        spec.compiler.inertiafromgeom = mujoco.mjtInertiaFromGeom.mjINERTIAFROMGEOM_AUTO
        for b in bodies:
            body = spec.body(m.body(b).name)
            body.explicitinertial, body.fullinertia = True, np.full(6, np.nan)
            body.mass, body.inertia = m.body_mass[b] * s, m.body_inertia[b] * s
            body.ipos, body.iquat = m.body_ipos[b], m.body_iquat[b]
    return write


def sequences(task: Task, replayer: Replayer, latency: int) -> sysid.ModelSequences:
    """One sysid sequence per replay window: the logged controls at ``latency`` on the physics step grid, the
    logged positions of the replayed joints at the control steps as the measured signal."""
    m, win, dt = task.model, replayer.win, task.model.opt.timestep
    names = [str(m.joint(int(np.searchsorted(m.jnt_qposadr, q, side="right") - 1)).name) for q in replayer.joints]
    mapping = {n: (Q, np.array([i])) for i, n in enumerate(names)}
    steps = win.target.shape[1]
    controls, measured = [], []
    for w in range(len(win.start)):
        ctrl = win.control[latency, w]
        controls.append(sysid.TimeSeries(np.arange(len(ctrl) + 1) * dt, np.vstack([ctrl, ctrl[-1:]])))
        measured.append(sysid.TimeSeries(np.arange(1, steps + 1) * task.decimation * dt,
                                         win.target[w][:, replayer.joints], mapping))
    spec = task.spec()
    logging.set_verbosity(logging.ERROR)  # sysid warns per window that the qpos signal is no MuJoCo sensor
    return sysid.ModelSequences(task.name, spec, [f"window{w}" for w in range(len(win.start))], list(win.start),
                                controls, measured, allow_missing_sensors=True)


def plain_residual(task: Task, replayer: Replayer):
    """Replayed minus logged positions of the replayed joints at the control steps."""
    joints, dec = replayer.joints, task.decimation

    def residual(params, predicted, measured, model, return_pred_all, state, **_):
        qpos = state[dec - 1 :: dec, 1 : 1 + model.nq][:, joints]
        return qpos - measured.data, sysid.TimeSeries(measured.times, qpos, measured.signal_mapping), measured
    return residual


def fit(task: Task, replayer: Replayer, twin: TwinSpec, profile: str, nthread: int):
    """sysid's fit on ``replayer``'s windows: ({name: (estimate, (lo, hi))}, seconds, least-squares iterations), the
    intervals holding together at 95%
    (MuJoCo's least squares prints each iteration; that goes to a buffer)."""
    params = parameters(task, profile)
    start = time.perf_counter()
    seqs = sequences(task, replayer, twin.params.latency_steps)
    residual_fn = sysid.build_residual_fn(models_sequences=[seqs], modify_residual=plain_residual(task, replayer),
                                          resample_true=False, n_threads=nthread)
    with contextlib.redirect_stdout(io.StringIO()):
        fitted, result = sysid.optimize(params, residual_fn, optimizer="mujoco", verbose=False)
    residuals, _, _ = residual_fn(fitted.as_vector(), fitted)
    _, half = sysid.calculate_intervals(residuals, result.jac)
    half = half * quantile(len(half)) / Z
    seconds = time.perf_counter() - start
    x = fitted.as_vector()
    estimates = {n: (float(v), (float(v - h), float(v + h))) for n, v, h in zip(fitted.keys(), x, half)}
    return estimates, seconds, len(result.extras["objective"])


def sim2edge_rows(twin: TwinSpec, truth: PhysicalParams, profile: str, joints: list[str]):
    """(name, truth, estimate, interval) of sim2edge's fit, per-joint values as effective scales on the nominal."""
    p, iv = twin.params, twin.intervals
    if profile == "global":
        return [(n, getattr(truth, n), getattr(p, n), iv[n]) for n in ("damping", "actuator_gain", "mass", "friction")]
    rows = []
    for field, by, glob in (("damping", "damping_by_joint", "damping"), ("gain", "gain_by_actuator", "actuator_gain")):
        g, t = getattr(p, glob), getattr(truth, glob)
        rows += [(f"{field}.{j}", t * getattr(truth, by)[j], g * getattr(p, by)[j],
                  tuple(g * v for v in iv[f"{by}.{j}"])) for j in joints]
    return rows + [(f"friction.{j}", truth.friction_by_joint[j], p.friction_by_joint[j], iv[f"friction_by_joint.{j}"])
                   for j in joints]


def compare(task: Task, replayer: Replayer, twin: TwinSpec, truth: PhysicalParams, profile: str,
            sim2edge_seconds: float, nthread: int) -> None:
    """Fit with sysid on ``replayer``'s windows and print one table against sim2edge's ``twin``."""
    fitted, seconds, iterations = fit(task, replayer, twin, profile, nthread)
    win = replayer.win
    print(f"\nsim2edge vs mujoco.sysid {mujoco.__version__}, same {len(win.start)} windows × {win.target.shape[1]} "
          f"control steps ({profile} profile); sysid at sim2edge's latency {twin.params.latency_steps}")
    cell = lambda t, v, iv: (f"{v:9.4f} {v / t - 1:+8.2%}  [{iv[0]:.4f}, {iv[1]:.4f}]  "  # noqa: E731
                             f"{'yes' if iv[0] <= t <= iv[1] else 'NO':3s}")
    print(f"{'parameter':15s} {'truth':>7s} | {'sim2edge':>9s} {'error':>8s}  interval          covers | "
          f"{'sysid':>9s} {'error':>8s}  interval          covers   (each side's intervals hold together at 95%)")
    for name, t, v, iv in sim2edge_rows(twin, truth, profile, actuated_joints(task.model)):
        note = "  (sim2edge: unidentifiable, held at prior)" if name in twin.unidentified else ""
        print(f"{name:15s} {t:7.4f} | {cell(t, v, iv)} | {cell(t, *fitted[name])}{note}")
    print(f"{'latency_steps':15s} {truth.latency_steps:7d} | {twin.params.latency_steps:9d} (searched)"
          f"{'':33s} | n/a: given sim2edge's (no integer delay search)")
    print(f"{'wall time':15s} {'':7s} | {sim2edge_seconds:8.1f} s (whole calibrate: latency search, fits, "
          f"bootstrap)  | {seconds:8.1f} s ({iterations} least-squares iterations, intervals); "
          f"sysid/sim2edge {seconds / sim2edge_seconds:.1f}×")
