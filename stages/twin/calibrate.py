"""Calibrate: fit the twin's physical parameters and actuation latency to logged trajectories.

Short windows of the logs are replayed from their logged start states with the logged
commanded controls, shifted by a candidate latency and held per control step. CMA-ES (the
``cmaes`` package) minimises the RMS error between replayed and logged joint positions over
log-scales of the scale parameters and a normalized friction; a whole generation (population × windows) replays in one
``mujoco.rollout`` call. Integer latency is searched: a short fit per candidate, then the
best one is fitted to the end. Afterwards each parameter's sensitivity (how much a 10%
change raises the replay error) is measured; a parameter the data cannot pin down is
flagged unidentifiable and held at its prior instead of being silently fitted.

The global fit is then the prior of a per-joint one: CMA-ES fits, per actuated joint (or per ``groups``
entry: joints that share hardware), log-multipliers on damping and on the gain of the actuators driving
it, with a Gaussian prior of width ``prior_width`` around 1 so a short log stays near the global fit,
and its friction. Last, the leftover replay error is compared with
the noise floor (the error sensor noise alone leaves); well above it, the twin names the joints it
misfits. Every fitted parameter, global and per joint, gets a 95% interval from a bootstrap over the logs'
episodes (``stages.twin.intervals``); an unidentifiable one gets its whole search range. Beside ``twin.json`` the
identified model is written as ``twin.xml`` (MJCF).
"""

from __future__ import annotations

import copy
import json
import logging
from xml.etree import ElementTree
from pathlib import Path

import mujoco
import numpy as np
import pyarrow as pa
from cmaes import CMA
from mujoco import rollout
from pydantic import BaseModel, ConfigDict, Field

from stages import logs, standin
from stages.artifacts import Dataset, Misfit, TwinSpec, atomic_dir, sha256_json
from stages.collect.store import dataset_files
from stages.sim.env import STATE_SPEC
from stages.sim.disturbance import peak_forces
from stages.sim.params import PhysicalParams, actuated_dofs, actuator_names, apply_params
from stages.sim.registry import load
from stages.sim.task import Task
from stages.twin.intervals import interval, resample

FITTED = ("damping", "actuator_gain", "mass", "friction")
LOG_SCALED = ("damping", "actuator_gain", "mass")
"""Searched as log-scales in [0.2, 5]; ``friction`` as a fraction in [0, 1] of ``FRICTION_RANGE`` × max actuator effort."""
FRICTION_RANGE = 0.2
PROBE = 1.1
"""Sensitivity probe: each fitted parameter scaled by 1.1 and 1/1.1 (friction: at least 1% of the max effort)."""
JOINT_FRICTION_UNIT = 0.01
"""The per-joint fit's friction unit, × max actuator effort: a CMA-ES step of 0.2 is 0.2% of the effort."""
log = logging.getLogger(__name__)


class CalibrateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    window: int = Field(20, ge=2, description="Replay window length in control steps.")
    max_windows: int = Field(192, ge=1, description="Windows sampled from the dataset.")
    generations: int = Field(40, ge=1, description="CMA-ES generations for the chosen latency.")
    search_generations: int = Field(8, ge=1, description="CMA-ES generations per latency candidate.")
    max_latency: int = Field(3, ge=0, description="Largest actuation latency tried, in control steps.")
    population: int = Field(8, ge=4)
    min_sensitivity: float = Field(0.02, ge=0, description="A 10% change must raise the replay error by this fraction, "
                                                          "else the parameter is unidentifiable.")
    joint_generations: int = Field(80, ge=0, description="CMA-ES generations of the per-joint fit (0: global only).")
    prior_width: float = Field(0.3, gt=0, description="1σ of the per-joint log-multipliers' prior around the global fit.")
    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict, description="Joints that share hardware, "
                                               "fitted as one multiplier: {group name: joint names}.")
    misfit_ratio: float = Field(2.0, gt=1, description="Replay error over the noise floor above which the twin "
                                                       "reports a misfit.")
    bootstrap: int = Field(400, ge=20, description="Episode resamples of the bootstrap intervals.")
    seed: int = 0
    nthread: int = 2


class Windows(BaseModel):
    """Replay windows: start states (W, nstate), controls per latency (L+1, W, T*decimation, nu), targets (W, T, nq),
    and the episode each was cut from (W,), numbered in dataset order."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    start: np.ndarray
    control: np.ndarray
    target: np.ndarray
    episode: np.ndarray


def windows(task: Task, dataset: Dataset, cfg: CalibrateConfig) -> Windows:
    """Cut every file of the dataset into replay windows (sampled without replacement, seeded)."""
    table = pa.concat_tables([logs.read(p) for p in dataset_files(dataset)])
    qpos, qvel, ctrl = (logs.columns(table, p) for p in ("qpos", "qvel", "ctrl"))
    episode = table.column("episode").to_numpy()
    boundaries = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1], True])  # files concatenate episode-wise
    starts = [s for b, e in zip(boundaries[:-1], boundaries[1:]) for s in range(b + cfg.max_latency, e - cfg.window, cfg.window)]
    if not starts:
        raise ValueError(f"dataset {dataset.path}: no episode is longer than window + max_latency "
                         f"({cfg.window} + {cfg.max_latency} steps)")
    rng = np.random.default_rng(cfg.seed)
    starts = np.sort(rng.choice(starts, size=min(cfg.max_windows, len(starts)), replace=False))
    m = task.model
    start = np.zeros((len(starts), mujoco.mj_stateSize(m, STATE_SPEC)))
    start[:, 1 : 1 + m.nq] = qpos[starts]
    start[:, 1 + m.nq : 1 + m.nq + m.nv] = qvel[starts]
    steps = starts[:, None] + np.arange(cfg.window)
    control = np.stack([np.repeat(ctrl[steps - lag], task.decimation, axis=1) for lag in range(cfg.max_latency + 1)])
    return Windows(start=start, control=control.astype(np.float64), target=qpos[steps + 1],
                   episode=np.searchsorted(boundaries, starts, side="right") - 1)


class Replayer:
    """Replays all windows for a batch of candidate parameter sets in one rollout call."""

    def __init__(self, task: Task, win: Windows, nthread: int) -> None:
        self.task, self.win = task, win
        self.pool = rollout.Rollout(nthread=nthread)
        self.datas = [mujoco.MjData(task.model) for _ in range(nthread)]
        self.joints = task.replayed_qpos

    def replay(self, candidates: list[PhysicalParams], start: np.ndarray | None = None) -> np.ndarray:
        """Replayed joint positions of each candidate (uses its ``latency_steps``), from the windows' start states
        or ``start``: (C, W, T, nq)."""
        task, n = self.task, len(self.win.start)
        start = self.win.start if start is None else start
        models = [apply_params(copy.deepcopy(task.model), task.model, p, task.mass_mask) for p in candidates]
        control = np.concatenate([self.win.control[p.latency_steps] for p in candidates])
        nstep = control.shape[1]
        state = np.empty((len(control), nstep, self.win.start.shape[1]))
        sensors = np.empty((len(control), nstep, task.model.nsensordata))
        self.pool.rollout([m for m in models for _ in range(n)], self.datas, np.tile(start, (len(models), 1)),
                          control, nstep=nstep, skip_checks=True, state=state, sensordata=sensors)
        qpos = state[:, task.decimation - 1 :: task.decimation, 1 : 1 + task.model.nq]
        return qpos.reshape(len(models), n, -1, task.model.nq)

    def residuals(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """Replayed minus logged positions of the task's replayed joints, per candidate and window: (C, W, T·joints)."""
        diff = (self.replay(candidates) - self.win.target)[..., self.joints]
        return diff.reshape(len(candidates), len(self.win.start), -1)

    def errors(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """RMS error of each candidate over every window, on the task's replayed joints."""
        return np.sqrt((self.residuals(candidates) ** 2).reshape(len(candidates), -1).mean(axis=1))


def max_effort(task: Task) -> float:
    """The largest actuator force or torque, the unit of the friction search: a motor's gear × control limit, a
    position servo's force limit (its control range is an angle, not an effort)."""
    return float(peak_forces(task.model).max())


class Search:
    """The CMA-ES search space: log-scales for ``LOG_SCALED``, a normalized fraction for friction."""

    def __init__(self, task: Task, prior: PhysicalParams) -> None:
        self.prior, self.friction_unit = prior, FRICTION_RANGE * max_effort(task)
        self.bounds = np.array([np.log([0.2, 5.0])] * len(LOG_SCALED) + [[0.0, 1.0]])
        self.start = np.array([0.0] * len(LOG_SCALED) + [0.05])

    def params(self, x: np.ndarray, latency: int) -> PhysicalParams:
        scales = {name: getattr(self.prior, name) * float(np.exp(v)) for name, v in zip(LOG_SCALED, x)}
        return self.prior.model_copy(update={**scales, "friction": float(x[-1]) * self.friction_unit,
                                             "latency_steps": latency})

    def point(self, params: PhysicalParams) -> np.ndarray:
        """The search point of ``params`` (the inverse of ``params``)."""
        return np.r_[[np.log(getattr(params, n) / getattr(self.prior, n)) for n in LOG_SCALED],
                     params.friction / self.friction_unit]

    def named(self, box: np.ndarray) -> dict[str, tuple[float, float]]:
        """(d, 2) search-space intervals as parameter values, by name."""
        values = [getattr(self.prior, n) * np.exp(box[i]) for i, n in enumerate(LOG_SCALED)]
        return {n: (float(lo), float(hi)) for n, (lo, hi) in zip(FITTED, [*values, box[-1] * self.friction_unit])}


def _fit(replayer: Replayer, search: Search, latency: int, generations: int, cfg: CalibrateConfig,
         optimizer: CMA | None = None) -> tuple[CMA, float]:
    """Run (or continue) CMA-ES for one latency; return the optimizer and the best error seen."""
    optimizer = optimizer or CMA(mean=search.start, sigma=0.3, bounds=search.bounds, population_size=cfg.population,
                                 seed=cfg.seed)
    best = np.inf
    for _ in range(generations):
        xs = [optimizer.ask() for _ in range(optimizer.population_size)]
        errs = replayer.errors([search.params(x, latency) for x in xs])
        optimizer.tell(list(zip(xs, errs.tolist())))
        best = min(best, float(errs.min()))
    return optimizer, best


class JointSearch:
    """The per-joint search space, per unit (an actuated joint, or one group of ``CalibrateConfig.groups``):
    log-multipliers on damping and on the gain of the actuators driving it, and its friction in units of
    ``JOINT_FRICTION_UNIT`` × max effort, up to ``FRICTION_RANGE`` × max effort (started at the global fit's)."""

    def __init__(self, task: Task, fitted: PhysicalParams, groups: dict[str, tuple[str, ...]]) -> None:
        model = task.model
        dofs = np.flatnonzero(actuated_dofs(model))
        actuated = [str(model.joint(j).name) for j in range(model.njnt) if model.jnt_dofadr[j] in dofs]
        grouped = {j for joints in groups.values() for j in joints}
        if unknown := grouped - set(actuated):
            raise ValueError(f"groups name joints that are not actuated joints of {task.name}: {sorted(unknown)}")
        self.units = {**{g: tuple(j) for g, j in groups.items()}, **{j: (j,) for j in actuated if j not in grouped}}
        drives = {a: str(model.joint(model.actuator_trnid[i, 0]).name) for i, a in enumerate(actuator_names(model))
                  if model.actuator_trntype[i] == mujoco.mjtTrn.mjTRN_JOINT}
        self.actuators = {u: tuple(a for a, j in drives.items() if j in joints) for u, joints in self.units.items()}
        self.fitted, self.friction_unit, n = fitted, JOINT_FRICTION_UNIT * max_effort(task), len(self.units)
        self.bounds = np.array([np.log([0.2, 5.0])] * 2 * n + [[0.0, FRICTION_RANGE / JOINT_FRICTION_UNIT]] * n)
        self.start = np.r_[np.zeros(2 * n), np.full(n, fitted.friction / self.friction_unit)]

    def params(self, x: np.ndarray) -> PhysicalParams:
        n = len(self.units)
        damping, gain, friction = (dict(zip(self.units, map(float, v))) for v in (np.exp(x[:n]), np.exp(x[n : 2 * n]),
                                                                                  x[2 * n :] * self.friction_unit))
        return self.fitted.model_copy(update={
            "damping_by_joint": {j: v for u, v in damping.items() for j in self.units[u]},
            "gain_by_actuator": {a: v for u, v in gain.items() for a in self.actuators[u]},
            "friction_by_joint": {j: v for u, v in friction.items() for j in self.units[u]}})

    def point(self, params: PhysicalParams) -> np.ndarray:
        """The search point of ``params`` (the inverse of ``params``; each unit read at its first joint)."""
        units = self.units.values()
        return np.r_[[np.log(params.damping_by_joint[j[0]]) for j in units],
                     [np.log(params.gain_by_actuator[a[0]]) for a in self.actuators.values()],
                     [params.friction_by_joint[j[0]] / self.friction_unit for j in units]]

    def named(self, box: np.ndarray) -> dict[str, tuple[float, float]]:
        """(d, 2) search-space intervals as per-joint values (multipliers, friction), by ``<field>.<name>``."""
        n, pair = len(self.units), lambda v: (float(v[0]), float(v[1]))  # noqa: E731
        damping, gain, friction = np.exp(box[:n]), np.exp(box[n : 2 * n]), box[2 * n :] * self.friction_unit
        return {**{f"damping_by_joint.{j}": pair(damping[i]) for i, u in enumerate(self.units) for j in self.units[u]},
                **{f"gain_by_actuator.{a}": pair(gain[i]) for i, u in enumerate(self.units) for a in self.actuators[u]},
                **{f"friction_by_joint.{j}": pair(friction[i]) for i, u in enumerate(self.units) for j in self.units[u]}}

    def prior_weights(self, replayer: Replayer, cfg: CalibrateConfig, noise: float) -> np.ndarray:
        """Per coordinate, the weight of its Gaussian prior in the per-joint objective (0: none): with residuals of std
        ``noise`` (the sensor noise estimate), mse + noise² · |x|² / (prior_width² · n) is the MAP objective, counting
        n = windows × replayed joints of them as independent (steps within a window are correlated)."""
        weight = noise**2 / (cfg.prior_width**2 * len(replayer.win.start) * len(replayer.joints))
        return np.r_[np.full(2 * len(self.units), weight), np.zeros(len(self.units))]


def fit_joints(replayer: Replayer, search: JointSearch, cfg: CalibrateConfig, noise: float) -> PhysicalParams:
    """CMA-ES on the per-joint values x, minimising the replay MSE plus a Gaussian prior on the log-multipliers
    around the global fit (``JointSearch.prior_weights``). Returns the search's mean, or the global fit where that scores
    better."""
    weight = search.prior_weights(replayer, cfg, noise)
    dim = len(search.bounds)
    optimizer = CMA(mean=search.start, sigma=min(0.2, cfg.prior_width), bounds=search.bounds, seed=cfg.seed,
                    population_size=max(cfg.population, 4 + int(3 * np.log(dim))))
    def scores(xs: list[np.ndarray]) -> list[float]:
        errs = replayer.errors([search.params(x) for x in xs])
        return [float(e**2 + weight @ x**2) for x, e in zip(xs, errs)]

    for _ in range(cfg.joint_generations):
        xs = [optimizer.ask() for _ in range(optimizer.population_size)]
        optimizer.tell(list(zip(xs, scores(xs))))
    mean, start = scores([optimizer.mean, search.start])
    return search.params(optimizer.mean if mean <= start else search.start)


def misfit(replayer: Replayer, fitted: PhysicalParams, ratio: float, seed: int) -> Misfit:
    """The leftover replay error against the noise floor: the error the twin itself would show with the logs'
    sensor noise (``fitted.obs_noise``) on the start states and on the targets."""
    task, win, sigma = replayer.task, replayer.win, fitted.obs_noise
    m, joints = task.model, replayer.joints
    noisy = win.start.copy()
    noisy[:, 1 : 1 + m.nq + m.nv] += np.random.default_rng(seed).normal(0, sigma, (len(noisy), m.nq + m.nv))
    clean, perturbed = replayer.replay([fitted]), replayer.replay([fitted], noisy)
    floor = np.sqrt(((perturbed - clean)[..., joints] ** 2).mean(axis=(0, 1, 2)) + sigma**2)
    error = np.sqrt(((clean - win.target)[..., joints] ** 2).mean(axis=(0, 1, 2)))
    names = [str(m.joint(int(np.searchsorted(m.jnt_qposadr, q, side="right") - 1)).name) for q in joints]
    total = float(np.sqrt((error**2).mean()) / np.sqrt((floor**2).mean()))
    worst = sorted((i for i in range(len(joints)) if error[i] > ratio * floor[i]), key=lambda i: -error[i] / floor[i])
    return Misfit(ratio=total, noise_floor=float(np.sqrt((floor**2).mean())),
                  joint_error=dict(zip(names, map(float, error))),
                  worst_joints=tuple(names[i] for i in worst) if total > ratio else ())


def sensitivity(replayer: Replayer, fitted: PhysicalParams, error: float) -> dict[str, float]:
    """Per fitted parameter: relative rise of the replay error when it is scaled by 1.1 and 1/1.1 (mean).

    Friction near zero is probed at ±1% of the max actuator effort instead."""
    floor = 0.01 * max_effort(replayer.task) / (PROBE - 1)
    probes = []
    for name in FITTED:
        value = getattr(fitted, name)
        if name == "friction" and value < floor:
            probes += [fitted.model_copy(update={name: value + floor * (PROBE - 1)}),
                       fitted.model_copy(update={name: max(value - floor * (PROBE - 1), 0.0)})]
        else:
            probes += [fitted.model_copy(update={name: value * PROBE}), fitted.model_copy(update={name: value / PROBE})]
    errs = replayer.errors(probes).reshape(len(FITTED), 2).mean(axis=1)
    return {name: float(e / error - 1) for name, e in zip(FITTED, errs)}


def noise_estimate(replayer: Replayer, fitted: PhysicalParams) -> float:
    """Sensor noise std from the one-step replay residual (start and target noise: var ≈ 2σ²)."""
    first = (replayer.replay([fitted])[0, :, 0] - replayer.win.target[:, 0])[:, replayer.joints]
    return float(np.sqrt((first**2).mean() / 2))


def bootstrap_intervals(replayer: Replayer, search: Search, joint_search: JointSearch | None,
                        global_fit: PhysicalParams, fitted: PhysicalParams, unidentified: tuple[str, ...],
                        cfg: CalibrateConfig, noise: float) -> dict[str, tuple[float, float]]:
    """95% bootstrap intervals (``stages.twin.intervals``) of the global fit's parameters (an unidentified one:
    its whole search range) and, given ``joint_search``, of the per-joint values, on the same episode resamples."""
    resamples = resample(replayer.win.episode, cfg.bootstrap, cfg.seed)
    latency = global_fit.latency_steps
    free = np.array([name not in unidentified for name in FITTED])
    box = interval(lambda xs: replayer.residuals([search.params(x, latency) for x in xs]), search.point(global_fit),
                   search.bounds, free, resamples, np.zeros(len(FITTED)))
    intervals = search.named(box)
    if joint_search is not None:
        box = interval(lambda xs: replayer.residuals([joint_search.params(x) for x in xs]), joint_search.point(fitted),
                       joint_search.bounds, np.ones(len(joint_search.bounds), bool), resamples,
                       joint_search.prior_weights(replayer, cfg, noise))
        intervals |= joint_search.named(box)
    return intervals


def calibrate(cfg: CalibrateConfig, dataset: Dataset, out_dir: Path) -> TwinSpec:
    """Fit damping, actuator gain, mass scale, friction and latency to ``dataset``; write ``out_dir/twin.json`` and a plot."""
    task = load(dataset.task)
    prior = task.nominal_params()
    search = Search(task, prior)
    replayer = Replayer(task, windows(task, dataset, cfg), cfg.nthread)
    searched = {lag: _fit(replayer, search, lag, cfg.search_generations, cfg) for lag in range(cfg.max_latency + 1)}
    latency = min(searched, key=lambda lag: searched[lag][1])
    optimizer, _ = _fit(replayer, search, latency, max(cfg.generations - cfg.search_generations, 0), cfg,
                        searched[latency][0])
    fitted = search.params(optimizer.mean, latency)
    after = float(replayer.errors([fitted])[0])
    sens = sensitivity(replayer, fitted, after)
    unidentified = tuple(name for name in FITTED if sens[name] < cfg.min_sensitivity)
    fitted = fitted.model_copy(update={name: getattr(prior, name) for name in unidentified})
    global_fit, noise = fitted, noise_estimate(replayer, fitted)
    joint_search = JointSearch(task, fitted, cfg.groups)
    if cfg.joint_generations:
        fitted = fit_joints(replayer, joint_search, cfg, noise)
    intervals = bootstrap_intervals(replayer, search, joint_search if cfg.joint_generations else None,
                                    global_fit, fitted, unidentified, cfg, noise)
    fitted = fitted.model_copy(update={"obs_noise": noise_estimate(replayer, fitted)})
    before, global_after, after = replayer.errors([prior, global_fit, fitted]).tolist()
    leftover = misfit(replayer, fitted, cfg.misfit_ratio, cfg.seed)
    if leftover.worst_joints:
        log.warning("%s twin misfit: replay error %.3g is %.1f× the noise floor %.3g, mostly on %s",
                    dataset.task, after, leftover.ratio, leftover.noise_floor, ", ".join(leftover.worst_joints))
    cov = optimizer._C
    corr = cov / np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
    robots = json.loads((dataset.path / "manifest.json").read_text())["robots"]
    spec = {
        "task": dataset.task,
        "params": fitted.model_dump(),
        "prior": prior.model_dump(),
        "intervals": intervals,
        "sensitivity": sens,
        "unidentified": list(unidentified),
        "correlation": {f"{a}~{b}": float(corr[i, j]) for i, a in enumerate(FITTED) for j, b in enumerate(FITTED) if i < j},
        "latency_search": {str(lag): err for lag, (_, err) in searched.items()},
        "dataset_digest": dataset.digest,
        "dataset_version": dataset.version,
        "robots": robots,
        "replay_error_before": before,
        "replay_error_global": global_after,
        "replay_error_after": after,
        "misfit": leftover.model_dump(),
        "windows": len(replayer.win.start),
        "window_steps": cfg.window,
    }
    profiles = {standin.profile_of(r) for r in robots}
    truth = standin.hidden_params(task.name, profiles.pop()) if len(profiles) == 1 and None not in profiles else None
    if truth is not None:
        spec["standin_truth"] = {"label": f"{standin.LABEL} hidden truth: for checking only, never used by the fit",
                                 **truth.model_dump()}
    digest = sha256_json(spec)
    with atomic_dir(out_dir) as tmp:
        (tmp / "twin.json").write_text(json.dumps({**spec, "digest": digest}, indent=2))
        write_mjcf(task, fitted, tmp / "twin.xml")
        plot_replay(task, replayer, prior, fitted, tmp / "replay.png")
    return TwinSpec(path=out_dir / "twin.json", digest=digest, task=dataset.task, params=fitted, intervals=intervals,
                    unidentified=unidentified, dataset_digest=dataset.digest, standin_truth=truth, replay_error_before=before,
                    replay_error_after=after, misfit=leftover)


def write_mjcf(task: Task, params: PhysicalParams, path: Path) -> None:
    """The task's MJCF with ``params`` written into it (damping, armature, friction per joint, gain per actuator,
    mass and inertia of the scaled bodies), as ``MjModel.from_xml_path`` loads it back.

    ``MjSpec`` sets the values; its writer prints 6 significant digits, so the changed attributes are then
    rewritten at full precision (the XML lists joints, bodies and actuators in model order)."""
    spec = task.spec()
    model = apply_params(spec.compile(), task.model, params, task.mass_mask)
    # set in the spec too, so that the writer emits them (a shortcut such as <motor> becomes <general gainprm=…>)
    for joint in spec.joints:
        dof = model.jnt_dofadr[joint.id]
        joint.damping[0], joint.armature = model.dof_damping[dof], model.dof_armature[dof]
        joint.frictionloss = model.dof_frictionloss[dof]
    for actuator in spec.actuators:
        actuator.gainprm[:] = model.actuator_gainprm[actuator.id]
        actuator.biasprm[:] = model.actuator_biasprm[actuator.id]
    scaled = params.mass != 1.0
    if scaled:
        spec.compiler.inertiafromgeom = mujoco.mjtInertiaFromGeom.mjINERTIAFROMGEOM_AUTO
        for body in spec.bodies:
            if task.mass_mask[body.id]:
                body.explicitinertial, body.mass, body.inertia = True, model.body_mass[body.id], model.body_inertia[body.id]
                body.ipos, body.iquat = model.body_ipos[body.id], model.body_iquat[body.id]
    root = ElementTree.fromstring(spec.to_xml())
    exact = lambda values: " ".join(repr(float(v)) for v in np.atleast_1d(values))  # noqa: E731
    world = root.find("worldbody")
    for j, element in enumerate(e for e in world.iter() if e.tag in ("joint", "freejoint")):
        dof = model.jnt_dofadr[j]
        if element.tag == "joint":
            element.attrib.update(damping=exact(model.dof_damping[dof]), armature=exact(model.dof_armature[dof]),
                                  frictionloss=exact(model.dof_frictionloss[dof]))
    for a, element in enumerate(root.find("actuator") if model.nu else []):
        element.attrib.update(gainprm=exact(model.actuator_gainprm[a]), biasprm=exact(model.actuator_biasprm[a]))
    for b, body in enumerate(world.iter("body"), start=1):
        if scaled and task.mass_mask[b]:
            body.find("inertial").attrib.update(mass=exact(model.body_mass[b]), diaginertia=exact(model.body_inertia[b]),
                                                pos=exact(model.body_ipos[b]), quat=exact(model.body_iquat[b]))
    path.write_text(ElementTree.tostring(root, encoding="unicode"))


def plot_replay(task: Task, replayer: Replayer, prior: PhysicalParams, fitted: PhysicalParams, path: Path) -> None:
    """Logged vs replayed joint positions (prior and fitted twin) on the three worst windows under the prior."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replays = replayer.replay([prior, fitted])
    worst = np.argsort(-((replays[0] - replayer.win.target) ** 2).mean(axis=(1, 2)))[:3]
    joints = replayer.joints
    fig, axes = plt.subplots(len(joints), len(worst), figsize=(4 * len(worst), 2.4 * len(joints)), squeeze=False)
    t = (np.arange(replayer.win.target.shape[1]) + 1) * task.ctrl_dt
    for col, w in enumerate(worst):
        for row, j in enumerate(joints):
            ax = axes[row, col]
            ax.plot(t, replayer.win.target[w, :, j], "k.", ms=3, label="logged")
            ax.plot(t, replays[0, w, :, j], "C3--", label="prior model")
            ax.plot(t, replays[1, w, :, j], "C0-", label="calibrated twin")
            ax.set_title(f"window {w}, qpos[{j}]", fontsize=9)
            ax.set_xlabel("s")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{task.name}: logged vs replayed joint positions")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def twin_from_file(path: Path | None, task: str) -> TwinSpec:
    """A TwinSpec read back from its ``twin.json`` (None: the task's nominal model, uncalibrated)."""
    if path is None:
        nominal = load(task).nominal_params()
        return TwinSpec(path=Path("nominal"), digest="nominal", task=task, params=nominal,
                        dataset_digest="", replay_error_before=0.0, replay_error_after=0.0)
    spec = json.loads(Path(path).read_text())
    truth = spec.get("standin_truth")
    return TwinSpec(path=Path(path), digest=spec["digest"], task=task, params=PhysicalParams(**spec["params"]),
                    intervals=spec.get("intervals", {}), unidentified=tuple(spec.get("unidentified", ())),
                    dataset_digest=spec.get("dataset_digest", ""),
                    standin_truth=PhysicalParams(**{k: v for k, v in truth.items() if k != "label"}) if truth else None,
                    replay_error_before=spec["replay_error_before"], replay_error_after=spec["replay_error_after"],
                    misfit=Misfit(**spec["misfit"]) if spec.get("misfit") else None)
