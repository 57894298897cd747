"""The searches of calibration: CMA-ES over global scales and latency (``Search``), then Levenberg-Marquardt per joint
(``JointSearch``)."""

from __future__ import annotations

import mujoco
import numpy as np
from cmaes import CMA

from stages.sim.disturbance import peak_forces
from stages.sim.params import PhysicalParams, actuated_dofs, actuator_names
from stages.sim.task import Task
from stages.twin.calibration_config import CalibrateConfig
from stages.twin.intervals import Optimum, polish, score
from stages.twin.replay import Replayer, noise_estimate

FITTED = ("damping", "actuator_gain", "mass", "friction")
LOG_SCALED = ("damping", "actuator_gain", "mass")
"""Searched as log-scales in [0.2, 5]; ``friction`` as a fraction in [0, 1] of ``FRICTION_RANGE`` × max actuator effort."""
FRICTION_RANGE = 0.2
JOINT_FRICTION_UNIT = 0.01
"""The per-joint fit's friction unit, × max actuator effort."""
RACE = 8
"""Levenberg-Marquardt trial steps each start of the per-joint fit runs before the better one goes on."""


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


def fit_global(replayer: Replayer, search: Search, latency: int, generations: int, cfg: CalibrateConfig,
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
    ``JOINT_FRICTION_UNIT`` × max effort, up to ``FRICTION_RANGE`` × max effort (started at the global fit's); then a
    log-multiplier on the mass (and inertia) of each of ``bodies``; then, with ``armature``, a log-multiplier on each
    unit's armature (where its joints have a datasheet armature: a multiplier on none moves nothing); then, with
    ``kv``, one on the velocity gain of each unit's position servos (where they have one). Each coordinate sets one
    per-element field of ``PhysicalParams`` for every joint (or actuator, or body) of its unit."""

    def __init__(self, task: Task, fitted: PhysicalParams, groups: dict[str, tuple[str, ...]],
                 bodies: tuple[str, ...] = (), armature: bool = False, kv: bool = False) -> None:
        model = task.model
        dofs = np.flatnonzero(actuated_dofs(model))
        actuated = [str(model.joint(j).name) for j in range(model.njnt) if model.jnt_dofadr[j] in dofs]
        grouped = {j for joints in groups.values() for j in joints}
        if unknown := grouped - set(actuated):
            raise ValueError(f"groups name joints that are not actuated joints of {task.name}: {sorted(unknown)}")
        self.units = {**{g: tuple(j) for g, j in groups.items()}, **{j: (j,) for j in actuated if j not in grouped}}
        names = actuator_names(model)
        drives = {a: str(model.joint(model.actuator_trnid[i, 0]).name) for i, a in enumerate(names)
                  if model.actuator_trntype[i] == mujoco.mjtTrn.mjTRN_JOINT}
        self.actuators = {u: tuple(a for a, j in drives.items() if j in joints) for u, joints in self.units.items()}
        heavy = {str(model.joint(j).name) for j in range(model.njnt) if model.dof_armature[model.jnt_dofadr[j]] > 0}
        damped = {a for i, a in enumerate(names) if model.actuator_biasprm[i, 2] != 0}
        self.armatures = tuple(u for u, joints in self.units.items() if set(joints) & heavy) if armature else ()
        self.kvs = tuple(u for u, acts in self.actuators.items() if set(acts) & damped) if kv else ()
        self.coordinates: list[tuple[str, tuple[str, ...]]] = [
            *(("damping_by_joint", self.units[u]) for u in self.units),
            *(("gain_by_actuator", self.actuators[u]) for u in self.units),
            *(("friction_by_joint", self.units[u]) for u in self.units),
            *(("mass_by_body", (b,)) for b in bodies),
            *(("armature_by_joint", self.units[u]) for u in self.armatures),
            *(("kv_by_actuator", self.actuators[u]) for u in self.kvs)]
        """(per-element field, the elements it sets) per search coordinate."""
        self.friction = np.array([f == "friction_by_joint" for f, _ in self.coordinates])
        """Which coordinates are frictions (in friction units, from 0); the others are log-multipliers."""
        self.late = np.array([f == "kv_by_actuator" for f, _ in self.coordinates])
        """Coordinates ``fit_joints``' race holds: below its force limit a servo's kv acts as its joint's damping does,
        so damping takes it first and kv splits from it after (arm6 with kv: from a global fit of gain 1.0 for truths of
        0.62-0.87 and friction 6.3 N m for 0.34-0.67, both released at once ended with wrist roll's kv ×1.7-2.0 for 0.73
        and a replay MSE 1.6-1.9× the truth's; staged, 0.70-0.72 and 1.01×)."""
        self.fitted, self.friction_unit = fitted, JOINT_FRICTION_UNIT * max_effort(task)
        self.bounds = np.where(self.friction[:, None], [0.0, FRICTION_RANGE / JOINT_FRICTION_UNIT], np.log([0.2, 5.0]))
        self.start = np.where(self.friction, fitted.friction / self.friction_unit, 0.0)

    def values(self, x: np.ndarray) -> np.ndarray:
        """Search coordinates as parameter values: multipliers, friction in joint units."""
        return np.where(self.friction, x * self.friction_unit, np.exp(x))

    def params(self, x: np.ndarray) -> PhysicalParams:
        fields: dict[str, dict[str, float]] = {f: {} for f in ("damping_by_joint", "gain_by_actuator",
                                                               "friction_by_joint", "mass_by_body")}
        for (field, elements), value in zip(self.coordinates, self.values(x).tolist()):
            fields.setdefault(field, {}).update(dict.fromkeys(elements, value))
        return self.fitted.model_copy(update=fields)

    def point(self, params: PhysicalParams) -> np.ndarray:
        """The search point of ``params`` (the inverse of ``params``; each coordinate read at its first element)."""
        values = np.array([getattr(params, field)[elements[0]] for field, elements in self.coordinates])
        return np.where(self.friction, values / self.friction_unit, np.log(np.where(self.friction, 1.0, values)))

    def starts(self) -> list[np.ndarray]:
        """The per-joint fits' starting points: ``start`` (the global fit's friction on every joint) and, where that
        friction is not 0, the same with no friction."""
        low = np.where(self.friction, 0.0, self.start)
        return [self.start] if np.array_equal(low, self.start) else [self.start, low]

    def coordinate_names(self) -> list[tuple[str, ...]]:
        """Per search coordinate, the ``<field>.<name>`` parameters it sets (a group's joints share one)."""
        return [tuple(f"{field}.{e}" for e in elements) for field, elements in self.coordinates]

    def named(self, box: np.ndarray) -> dict[str, tuple[float, float]]:
        """(d, 2) search-space intervals as per-element values (multipliers, friction), by ``<field>.<name>``."""
        lo, hi = self.values(box[:, 0]), self.values(box[:, 1])
        return {name: (float(a), float(b)) for names, a, b in zip(self.coordinate_names(), lo, hi) for name in names}

    def prior_weights(self, replayer: Replayer, cfg: CalibrateConfig, noise: float,
                      independent: int | None = None) -> np.ndarray:
        """Per coordinate, the weight of its Gaussian prior in the per-joint objective (0: none): with residuals of std
        ``noise`` (the sensor noise estimate), mse + noise² · |x|² / (prior_width² · n) is the MAP objective, counting
        n = ``independent`` of them as independent, by default windows × residuals per step (``Replayer.width``): steps
        within a window are correlated by the noise on its logged start. With the starts fitted (``stages.twin.starts``)
        that correlation is gone and every residual counts. The log-multipliers (damping, gain, mass, armature, kv)
        have it; friction has none."""
        count = len(replayer.win.start) * replayer.width if independent is None else independent
        return np.where(self.friction, 0.0, noise**2 / (cfg.prior_width**2 * count))


def fit_joints(replayer: Replayer, search: JointSearch, cfg: CalibrateConfig, noise: float) -> tuple[Optimum, float]:
    """Levenberg-Marquardt (``intervals.polish``) on the per-joint values x, minimising the replay MSE plus a Gaussian
    prior on the log-multipliers around the global fit (``JointSearch.prior_weights``): the least-squares optimum, which
    is the per-joint estimate. It never scores worse than the global fit, where it starts.

    Two starts race ``RACE`` trial steps (servo kv held: ``JointSearch.late``), and the better one takes the rest of
    ``cfg.joint_steps`` with every coordinate free: the global fit's
    friction on every joint (``JointSearch.start``), and no friction. Why: a global fit that cannot represent per-joint
    damping makes friction stand in for it (arm6's per-joint stand-in: 6.2 N m globally for truths of 0.34-0.67 N m).
    On the reacher (5 min of logs: 0.44 N m globally, truths 0.02 and 0.06 N m) joint 1's friction trades against its
    damping along a narrow valley, which the search follows down from either start (0.09 N m from no friction in 20
    steps); ``search_joints`` (two CMA-ES starts of 80 generations, 1,444 replays) ended at the same point (0.08 N m)
    in 4x the time. On 2 minutes of logs, though, the search stopped at a local minimum with joint 1's friction at 0
    and its damping 27% high, which only the CMA-ES race left: so calibration runs it where this fit leaves a misfit.

    The prior's weight goes as the sensor noise: ``noise``, estimated from the global fit's one-step replay error, is
    estimated again at the race's winner, and the lower one weights the rest of the fit; it is returned with the
    optimum. Why: a global fit that cannot represent the robot inflates it (arm6 with servo kv: 0.0069 for 0.002), the
    prior then weighs 12× what it should, and along a valley of values that trade (a wrist's kv, gain, damping and
    friction) it, not the logs, placed the fit: wrist roll's kv ×0.85 for 0.73 with its interval missing; re-weighted,
    ×0.70-0.72.
    """
    prior, every = search.prior_weights(replayer, cfg, noise), np.ones(len(search.bounds), bool)

    def fit(x: np.ndarray, trials: int, free: np.ndarray, prior: np.ndarray) -> Optimum:
        return polish(lambda xs: replayer.residuals([search.params(v) for v in xs]), x, search.bounds, free, prior,
                      trials)

    racers = [fit(x, min(RACE, cfg.joint_steps), ~search.late, prior) for x in search.starts()]
    best = min(racers, key=lambda o: score(o.residuals, o.x, prior))
    noise = min(noise, noise_estimate(replayer, search.params(best.x)))
    rest = cfg.joint_steps - RACE
    if rest <= 0 and not search.late.any():
        return best, noise
    return fit(best.x, max(rest, 0), every, search.prior_weights(replayer, cfg, noise)), noise


def search_joints(replayer: Replayer, search: JointSearch, cfg: CalibrateConfig, noise: float) -> np.ndarray:
    """CMA-ES on the per-joint values x, minimising the replay MSE plus a Gaussian prior on the log-multipliers
    around the global fit (``JointSearch.prior_weights``), for when ``fit_joints`` stops in a local minimum. Returns
    the search's mean, or the global fit's point where that scores better.

    Two starts (``JointSearch.starts``) each run all the generations, and the better mean is kept: from the global
    fit's friction the search's steps of 0.2 units never came back down on arm6's per-joint stand-in (it ended at
    1.5-12 N m, its replay error 10x the truth's), and on the reacher it stalled at 0.24 N m where no friction reaches
    0.08 N m; a race over a quarter of the generations picked the stalled start.
    """
    weight, dim = search.prior_weights(replayer, cfg, noise), len(search.bounds)

    def scores(xs: list[np.ndarray]) -> list[float]:
        return [score(r, x, weight) for x, r in zip(xs, replayer.residuals([search.params(x) for x in xs]))]

    def run(optimizer: CMA, generations: int) -> CMA:
        for _ in range(generations):
            xs = [optimizer.ask() for _ in range(optimizer.population_size)]
            optimizer.tell(list(zip(xs, scores(xs))))
        return optimizer

    racers = [run(CMA(mean=x, sigma=min(0.2, cfg.prior_width), bounds=search.bounds, seed=cfg.seed,
                      population_size=max(cfg.population, 4 + int(3 * np.log(dim)))), cfg.joint_generations)
              for x in search.starts()]
    optimizer = racers[int(np.argmin(scores([o.mean for o in racers])))]
    mean, start = scores([optimizer.mean, search.start])
    return optimizer.mean if mean <= start else search.start
