"""95% bootstrap intervals of the twin's fitted parameters (issue 33): they cover the stand-in's hidden truth."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.collect.rollouts import record
from stages.collect.store import DatasetStore
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.twin.search import FITTED
from stages.twin.calibrate import CalibrateConfig, calibrate
from stages.twin.twin_files import twin_from_file
from stages.twin.intervals import (Optimum, debiased, interval, polish, prior_dominated, quantile, resample,
                                   start_spread)

CHEAP = CalibrateConfig(window=10, max_windows=36, generations=16, search_generations=4, max_latency=0,
                        joint_steps=0, bootstrap=200)
"""Short windows, few generations: the point estimate is rough, the intervals must still hold."""


def hidden(seed: int) -> PhysicalParams:
    """A cart-pole stand-in with its own hidden damping, gain, mass and friction."""
    rng = np.random.default_rng(seed)
    return PhysicalParams(damping=rng.uniform(0.6, 1.8), actuator_gain=rng.uniform(0.7, 1.2),
                          mass=rng.uniform(0.7, 1.4), friction=rng.uniform(0.05, 0.5), obs_noise=0.002)


def twin_of(truth: PhysicalParams, seed: int, tmp_path):
    task = load("cartpole")
    log = record(task, truth, 12, seed, tmp_path / f"log{seed}.parquet", f"drawn-cartpole-{seed}")
    dataset = DatasetStore(tmp_path / f"ds{seed}", task, "cartpole").ingest([log], "test").dataset
    return calibrate(CHEAP.model_copy(update={"seed": seed}), dataset, tmp_path / f"twin{seed}")


@pytest.mark.slow
def test_intervals_cover_the_hidden_truth_of_20_standins(tmp_path):
    covered = []
    for seed in range(20):
        truth = hidden(seed)
        twin = twin_of(truth, seed, tmp_path)
        covered += [twin.intervals[n][0] <= getattr(truth, n) <= twin.intervals[n][1] for n in FITTED]
    assert np.mean(covered) >= 0.9, f"{sum(covered)} of {len(covered)} intervals hold the truth"


def test_intervals_are_written_and_read_back(tmp_path):
    twin = twin_of(hidden(0), 0, tmp_path)
    assert set(twin.intervals) == set(FITTED)
    for name, (lo, hi) in twin.intervals.items():
        assert lo <= getattr(twin.params, name) <= hi, name
    spec = json.loads(twin.path.read_text())
    assert spec["intervals"] == {k: list(v) for k, v in twin.intervals.items()} and spec["start_smoothing"] == 1
    assert twin_from_file(twin.path, "cartpole").intervals == twin.intervals


def test_the_intervals_of_a_pass_hold_the_truth_together():
    """Six coordinates of a linear least-squares problem with correlated columns, 200 noisy draws: the six intervals of
    a draw all hold the truth in about 95% of draws (six separate 95% intervals would all hold in 0.95⁶ = 74%), and
    each is the quantile of six (2.63) over one's (1.96) wider than a single 95% interval."""
    rng = np.random.default_rng(0)
    d, windows, per = 6, 40, 5
    a = rng.normal(size=(windows, per, d)) + 0.5 * rng.normal(size=(windows, per, 1))
    truth, bounds = rng.uniform(-0.5, 0.5, d), np.tile([-10.0, 10.0], (d, 1))
    free, prior = np.ones(d, bool), np.zeros(d)
    held = []
    for draw in range(200):
        b = np.einsum("wmk,k->wm", a, truth) + rng.normal(0, 0.05, (windows, per))
        residuals = lambda xs: np.stack([np.einsum("wmk,k->wm", a, x) - b for x in xs])  # noqa: E731
        box = interval(polish(residuals, np.zeros(d), bounds, free, prior), bounds, free,
                       resample(np.arange(windows), 1000, draw), prior)
        held.append(((box[:, 0] <= truth) & (truth <= box[:, 1])).all())
    assert 0.9 <= np.mean(held), f"all six held in {np.mean(held):.0%} of draws"
    assert quantile(1) == pytest.approx(1.959964) and quantile(6) == pytest.approx(2.631, abs=1e-3)


def test_an_unidentifiable_parameter_gets_its_whole_search_range():
    """x1 moves the residuals, x0 barely does (its standard error would be far beyond its range): x0's interval spans its
    bounds, x1's is narrow around its fit; a parameter held fixed (flagged unidentifiable) gets its bounds too."""
    rng = np.random.default_rng(0)
    noise, pattern = rng.normal(0, 0.01, (2, 40, 5))
    residuals = lambda xs: np.stack([noise + x[1] - 0.5 + 1e-3 * pattern * x[0] for x in xs])  # noqa: E731
    bounds = np.array([[-1.6, 1.6], [0.0, 1.0]])
    free, prior = np.array([True, True]), np.zeros(2)
    box = interval(polish(residuals, np.array([0.0, 0.5]), bounds, free, prior), bounds, free,
                   resample(np.arange(40), 200, 0), prior)
    np.testing.assert_allclose(box[0], bounds[0])
    assert box[1, 0] < 0.5 < box[1, 1] and box[1, 1] - box[1, 0] < 0.01
    free = np.array([False, True])
    fixed = interval(polish(residuals, np.array([0.0, 0.5]), bounds, free, prior), bounds, free,
                     resample(np.arange(40), 200, 0), prior)
    np.testing.assert_allclose(fixed[0], bounds[0])


def test_a_coordinate_its_prior_pins_more_than_the_logs_is_named():
    """Each coordinate's variance from the logs alone against its prior's: the logs pin coordinate 0, the prior pins
    coordinate 1, coordinate 2 has no prior (friction), coordinate 3 is not fitted. Then two coordinates that each move
    the replays as much as coordinate 0 does, but only together (a valley): both are named, though along each alone
    the logs' curvature is far above the prior's weight."""
    pattern = np.random.default_rng(0).normal(size=(3, 40, 5))
    jac = pattern * np.array([1.0, 1e-3, 1e-6])[:, None, None]
    optimum = Optimum(np.zeros(4), np.zeros((40, 5)), jac)
    flags = prior_dominated(optimum, np.array([True, True, True, False]), np.array([1e-4, 1e-4, 0.0, 1.0]))
    assert flags.tolist() == [False, True, False, False]
    valley = np.stack([pattern[0], pattern[0] + 1e-4 * pattern[1], pattern[2]])
    prior = np.array([1e-4, 1e-4, 1e-4])
    assert (valley**2).mean(axis=(1, 2)).min() > 1e3 * prior.max()
    flags = prior_dominated(Optimum(np.zeros(3), np.zeros((40, 5)), valley), np.ones(3, bool), prior)
    assert flags.tolist() == [True, True, False]


def test_start_noise_refits_find_each_draws_optimum_and_its_mean_offset():
    """Linear residuals r = (A x - b_i) per draw i: one chord step with the Jacobian A is each draw's least-squares
    fit, so the offsets are the draws' own optima less the clean one's; a mean offset of 5 standard errors on
    coordinate 0 is the bias, coordinate 1's draws average out and get none."""
    rng = np.random.default_rng(1)
    a = rng.normal(size=(30, 4, 2))
    offsets = np.c_[rng.normal(0.05, 0.01, 32), rng.normal(0.0, 0.01, 32)]
    targets = np.stack([np.einsum("wmk,k->wm", a, np.array([0.3, -0.2]) + o) for o in np.r_[[[0, 0]], offsets]])

    def residuals(xs):
        return np.stack([np.einsum("wmk,k->wm", a, x) - targets[i] for i, x in enumerate(xs)])

    x = np.array([0.3, -0.2])
    optimum = Optimum(x, residuals([x])[0], np.moveaxis(a, 2, 0))
    bounds, free, prior = np.array([[-1.0, 1.0], [-1.0, 1.0]]), np.array([True, True]), np.zeros(2)
    noise = start_spread(residuals, 32, optimum, bounds, free, prior)
    assert noise.bias[0] == pytest.approx(offsets[:, 0].mean(), rel=1e-6) and noise.bias[1] == 0.0
    assert noise.spread[0] > noise.spread[1] > 0.005
    fixed, box = debiased(x, np.array([[0.2, 0.4], [-0.3, -0.1]]), free, noise.bias, bounds)
    assert fixed[0] == pytest.approx(0.3 - noise.bias[0]) and fixed[1] == -0.2
    np.testing.assert_allclose(box[0], [0.2 - noise.bias[0], 0.4 - noise.bias[0]])
