"""Bootstrap 95% intervals of fitted twin parameters (issue 33).

The logs' episodes are resampled with replacement: a resample weights each replay window by how often its episode
was drawn, and is refitted by a Gauss-Newton step on its own weighted replay error (plus the fit's Gaussian prior,
if any) from the least-squares optimum: the point estimate polished by Levenberg-Marquardt on all the data. The
residuals' Jacobian is taken by central differences in the search space, 2·d + 1 replays of the windows in one
batched ``mujoco.rollout`` call per step, and the last one serves all resamples. Resampling whole
episodes keeps the correlation of the replay error within an episode, so the spread holds when the model is wrong; a
weakly identified parameter leaves the error flat, its refits step far and its interval reaches the search bounds.
The refits' percentiles at the pass's level are the interval.

The intervals of one pass (the global fit's, or the per-joint fit's) hold together: each is at the level
LEVEL^(1/d) for the pass's d free coordinates (Šidák), so for jointly normal estimates all d hold the truth with
at least 95% probability whatever their correlation, and each one alone with more. Why: training randomizes over the
box they span, which covers the robot only where every one of them holds, and six exact 95% intervals (the per-joint
reacher's) all hold only 0.95⁶ = 74% of the time. On that stand-in (seed 0) joint 0's gain, 2.4 standard deviations
from its truth, fell outside its 95% interval by 0.0004%; at the pass's level (2.63) it does not.

The episode bootstrap misses what noise on the replays' start states does to the fit: its refits are linear in the
residuals at the estimate, while a start's noise moves the whole replay and its slopes. On the per-joint reacher
(σ = 0.002) the start positions' noise (not the velocities') moved joint 1's gain +0.04% and damping +0.2%, outside
episode-bootstrap intervals of ±0.03% and ±0.2%; replays from the noise-free starts recover both within 0.01%. So
``start_spread`` measures it by a parametric bootstrap: the fitted twin's own replays from the logged starts stand in
for the logs, the starts get fresh noise, and each draw is refitted by Gauss-Newton steps on its own replays with the
optimum's Jacobian held (the chord method: one replay a step, not a Jacobian's 2·d + 1); the RMS of the draws' offsets
from the noise-free refit (any bias included) widens the interval, in quadrature (``interval``), and in the per-joint
fit their mean, where significant, is subtracted from the estimate and its interval (``debiased``): on the per-joint
reacher (5 min of logs) it took joint 1's friction from 0.079 to 0.062 N m (truth 0.06).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from scipy.stats import norm

LEVEL = 0.95
"""The probability with which one pass's intervals all hold the truth (``quantile``)."""
Z = 1.959964
"""The standard normal's 97.5% quantile: one 95% interval's."""
STEP = 0.02
"""Central-difference step in search units (2% on a log-scale)."""
POLISH = 8
"""Levenberg-Marquardt trial steps on all the data before the bootstrap: CMA-ES's mean may stop short of the optimum."""
CHORD = 1
"""Chord steps of each start-noise refit (``start_spread``): a draw's optimum lies about an interval's width from the
fit's, where the fit's Jacobian still holds; on the per-joint reacher 32 draws' mean offsets after one step and after
three agreed within 3% (joint 1's friction 0.0083 and 0.0085 units)."""
DAMPING = 1e-3
"""Levenberg-Marquardt's first damping: steps nearly Gauss-Newton, shortened tenfold after each rejected one."""
MIN_EPISODES = 10
"""With fewer episodes than this, windows are resampled instead of episodes."""

Residuals = Callable[[list[np.ndarray]], np.ndarray]
"""Replay residuals of search points: (C, W, m) for C points, W windows, m residuals per window."""


def tail(d: int) -> float:
    """The probability each tail of one of d intervals leaves out, for all d to hold with ``LEVEL`` (Šidák)."""
    return (1 - LEVEL ** (1 / d)) / 2


def quantile(d: int) -> float:
    """The standard normal's quantile of one of d intervals that hold together with ``LEVEL`` (``tail``): 1.96 for
    one, 2.64 for six."""
    return float(norm.isf(tail(d)))


def t_quantile(dof: int, z: float = Z) -> float:
    """Student t's quantile with ``dof`` degrees of freedom at the standard normal's ``z``, by its Cornish-Fisher
    expansion."""
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


@dataclass(frozen=True)
class Resamples:
    """Window weights (n, W) of n resamples of ``groups`` episodes (or windows) drawn with replacement."""

    weights: np.ndarray
    groups: int

    def widening(self, z: float = Z) -> float:
        """The bootstrap's spread of a mean over g groups falls short of Student's t interval by (t over z quantile)
        × √(g / (g − 1)), t's quantile at the standard normal's ``z`` with g − 1 degrees of freedom (``t_quantile``)."""
        dof = self.groups - 1
        return t_quantile(dof, z) / z * np.sqrt(self.groups / dof)


def resample(episode: np.ndarray, n: int, seed: int) -> Resamples:
    """``n`` resamples of the episodes (or, with fewer than ``MIN_EPISODES``, of the windows) with replacement; a
    window weighs as often as its episode was drawn."""
    groups = episode if len(np.unique(episode)) >= MIN_EPISODES else np.arange(len(episode))
    ids, inverse = np.unique(groups, return_inverse=True)
    draws = np.random.default_rng(seed).integers(len(ids), size=(n, len(ids)))
    counts = np.stack([np.bincount(d, minlength=len(ids)) for d in draws])
    return Resamples(weights=counts[:, inverse].astype(np.float64), groups=len(ids))


def jacobian(residuals: Residuals, x: np.ndarray, bounds: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Residuals at ``x`` (W, m) and their central-difference derivatives along the free coordinates (k, W, m);
    a step that would leave the bounds is cut at them."""
    index = np.flatnonzero(free)
    up, down = np.tile(x, (len(index), 1)), np.tile(x, (len(index), 1))
    up[range(len(index)), index] = np.minimum(x[index] + STEP, bounds[index, 1])
    down[range(len(index)), index] = np.maximum(x[index] - STEP, bounds[index, 0])
    r = residuals([x, *up, *down])
    k = len(index)
    width = (up - down)[range(k), index]
    return r[0], (r[1 : 1 + k] - r[1 + k :]) / width[:, None, None]


def steps(r0: np.ndarray, jac: np.ndarray, x: np.ndarray, free: np.ndarray, weights: np.ndarray,
          prior: np.ndarray, damping: float = 0.0) -> np.ndarray:
    """(B, k) Gauss-Newton steps of the free coordinates from ``x``, one per weighting of the windows, on the weighted
    mean squared residual plus ``prior`` · x² per coordinate (its weight; 0: none); ``damping`` > 0 makes them
    Levenberg-Marquardt steps (the normal matrix's diagonal scaled by 1 + damping). NaN where singular."""
    norm = weights.sum(axis=1) * r0.shape[1]
    p = prior[free]
    a = np.einsum("bw,wij->bij", weights, np.einsum("iwm,jwm->wij", jac, jac)) / norm[:, None, None] + np.diag(p)
    a = a + damping * a * np.eye(a.shape[-1])
    g = np.einsum("bw,wi->bi", weights, np.einsum("iwm,wm->wi", jac, r0)) / norm[:, None] + p * x[free]
    try:
        return np.linalg.solve(a, -g[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return np.full_like(g, np.nan)


@dataclass(frozen=True)
class Optimum:
    """The least-squares optimum in search units, with the replay residuals (W, m) and their Jacobian (k, W, m) there."""

    x: np.ndarray
    residuals: np.ndarray
    jacobian: np.ndarray


def score(residuals: np.ndarray, x: np.ndarray, prior: np.ndarray) -> float:
    """The least-squares objective: mean squared residual plus the Gaussian prior's ``prior`` · x²."""
    return float((residuals**2).mean() + prior @ x**2)


def polish(residuals: Residuals, x: np.ndarray, bounds: np.ndarray, free: np.ndarray, prior: np.ndarray,
           trials: int = POLISH) -> Optimum:
    """Levenberg-Marquardt on all windows from ``x`` (at most ``trials`` trial steps, each one replay; a Jacobian
    where a step is taken): the least-squares optimum near ``x``, the twin's point estimate and the centre of its
    bootstrap. CMA-ES's mean stops short of it along valleys, such as a joint's damping against its friction."""
    r0, jac = jacobian(residuals, x, bounds, free)
    best, damping = score(r0, x, prior), DAMPING
    for _ in range(trials):
        step = steps(r0, jac, x, free, np.ones((1, len(r0))), prior, damping)[0]
        if not np.isfinite(step).all():
            break
        trial = x.copy()
        trial[free] = np.clip(x[free] + step, *bounds[free].T)
        trial_score = score(residuals([trial])[0], trial, prior)
        if trial_score < best:
            x, best, damping = trial, trial_score, damping / 10
            r0, jac = jacobian(residuals, x, bounds, free)
        else:
            damping *= 10
    return Optimum(x, r0, jac)


def chord(residuals: Residuals, optimum: Optimum, count: int, bounds: np.ndarray, free: np.ndarray,
          prior: np.ndarray) -> np.ndarray:
    """(count, d) least-squares fits of ``count`` problems near ``optimum`` by ``CHORD`` Gauss-Newton steps each with
    the optimum's Jacobian held; ``residuals`` replays point i on problem i, all in one call a step, and a step that
    does not lower a problem's objective is not taken."""
    x, every = np.tile(optimum.x, (count, 1)), np.ones((1, optimum.residuals.shape[0]))
    r = residuals(list(x))
    for _ in range(CHORD):
        trial = x.copy()
        for i in range(count):
            step = steps(r[i], optimum.jacobian, x[i], free, every, prior)[0]
            if np.isfinite(step).all():
                trial[i, free] = np.clip(x[i, free] + step, *bounds[free].T)
        r_trial = residuals(list(trial))
        better = np.array([score(r_trial[i], trial[i], prior) < score(r[i], x[i], prior) for i in range(count)])
        x[better], r[better] = trial[better], r_trial[better]
    return x


@dataclass(frozen=True)
class StartNoise:
    """What noise on the replays' start states does to the fit, per free coordinate: ``spread``, the RMS of the draws'
    offsets × t over z for as many draws at the pass's ``quantile`` (``t_quantile``: an RMS of few draws is itself
    uncertain), and ``bias``, their mean where it lies beyond two standard errors of it, else 0."""

    spread: np.ndarray
    bias: np.ndarray


def start_spread(residuals: Residuals, draws: int, optimum: Optimum, bounds: np.ndarray, free: np.ndarray,
                 prior: np.ndarray) -> StartNoise:
    """The offsets of the free coordinates' refits (``chord`` from ``optimum``) on ``draws`` noisy problems (the fitted
    twin's own replays as targets, its starts with fresh noise) from the refit on the clean one (the same without the
    noise): ``residuals`` replays point 0 on the clean problem, point i on draw i."""
    fits = chord(residuals, optimum, draws + 1, bounds, free, prior)[:, free]
    offsets = fits[1:] - fits[0]
    mean, error = offsets.mean(axis=0), offsets.std(axis=0, ddof=1) / np.sqrt(draws)
    z = quantile(int(free.sum()))
    return StartNoise(spread=t_quantile(draws, z) / z * np.sqrt((offsets**2).mean(axis=0)),
                      bias=np.where(np.abs(mean) > 2 * error, mean, 0.0))


def debiased(x: np.ndarray, box: np.ndarray, free: np.ndarray, bias: np.ndarray,
             bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and its interval ``box`` (d, 2) less the start noise's ``bias`` on the free coordinates (the bootstrap's
    bias correction), within the bounds and the estimate within its interval."""
    index = np.flatnonzero(free)
    x, box = x.copy(), box.copy()
    x[index] = np.clip(x[index] - bias, *bounds[index].T)
    box[index] = np.clip(box[index] - bias[:, None], bounds[index, :1], bounds[index, 1:])
    box[index, 0], box[index, 1] = np.minimum(box[index, 0], x[index]), np.maximum(box[index, 1], x[index])
    return x, box


def interval(optimum: Optimum, bounds: np.ndarray, free: np.ndarray, resamples: Resamples,
             prior: np.ndarray, spread: np.ndarray | None = None) -> np.ndarray:
    """(d, 2) bootstrap interval per coordinate in search units around ``optimum`` (from ``polish``), all the free
    ones holding together with ``LEVEL``: percentiles (``tail``) of the resamples' refits (a Gauss-Newton step each
    from the optimum, less the step all the data takes from there: on a rough replay error the polish stops short of
    stationary, and uncorrected refits would all fall on one side), widened for few groups (``Resamples.widening``)
    and in quadrature for the start noise's ``spread`` (× ``quantile``), then to contain the optimum, and cut at the
    bounds.
    A coordinate that is not free, or whose refits are not all finite, gets the whole search range."""
    out = bounds.astype(np.float64).copy()
    if not free.any():
        return out
    x, d = optimum.x, int(free.sum())
    z, out_of_each = quantile(d), tail(d)
    every = np.ones_like(resamples.weights[0])
    refits = steps(optimum.residuals, optimum.jacobian, x, free, np.vstack([every, resamples.weights]), prior)
    fits = x[free] + resamples.widening(z) * (refits[1:] - refits[0])
    lo, hi = np.percentile(fits, (100 * out_of_each, 100 * (1 - out_of_each)), axis=0)
    extra = (z * (np.zeros(d) if spread is None else spread)) ** 2
    lo = x[free] - np.sqrt(np.maximum(x[free] - lo, 0) ** 2 + extra)
    hi = x[free] + np.sqrt(np.maximum(hi - x[free], 0) ** 2 + extra)
    finite = np.isfinite(fits).all(axis=0)
    index = np.flatnonzero(free)[finite]
    out[index, 0] = np.clip(np.minimum(lo[finite], x[index]), *bounds[index].T)
    out[index, 1] = np.clip(np.maximum(hi[finite], x[index]), *bounds[index].T)
    return out


def prior_dominated(optimum: Optimum, free: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Per coordinate: whether its prior pins it more than the logs do: whether its variance from the logs alone (the
    diagonal of the inverse of the mean squared residual's curvature, the Jacobian's mean outer product, so values
    that trade along a valley count as the valley allows) exceeds its prior's (1 / its weight). Then the interval is
    mostly the prior's width, not what the logs showed. Why the inverse, not the curvature along each coordinate: on
    arm6 with per-joint armature, shoulder pan's armature and link 1's mass (the base link turns about the vertical
    axis, out of gravity's reach) each moved the replays, but only together; neither was named, and the armature's
    interval, [1.141, 1.195], missed its truth 1.138. Directions the logs do not move at all count as infinite."""
    out = np.zeros(len(free), bool)
    jac = optimum.jacobian.reshape(len(optimum.jacobian), -1)
    values, vectors = np.linalg.eigh(jac @ jac.T / jac.shape[1])
    flat = values <= values.max() * 1e-12
    variance = (vectors[:, ~flat] ** 2 / values[~flat]).sum(axis=1)
    unmoved = (vectors[:, flat] ** 2).sum(axis=1) > 1e-12
    weight = prior[free]
    out[np.flatnonzero(free)] = (weight > 0) & (unmoved | (variance * weight > 1))
    return out
