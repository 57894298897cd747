"""Replay starts fitted with the parameters (errors in variables, ``stages.twin.starts``; issue 33)."""

from __future__ import annotations

import numpy as np
import pytest

from stages import standin
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore
from stages.sim.registry import load
from stages.twin.calibrate import CalibrateConfig, calibrate
from stages.twin.replay import Replayer, windows
from stages.twin.episodes import limited_joints
from stages.twin.starts import LIMIT_MARGIN, Profile, off_limits, start_columns

SIGMA = 0.002


@pytest.fixture(scope="module")
def clean_and_noisy(tmp_path_factory):
    """The per-joint reacher's windows from a noise-free log (40 episodes), and the same with noise on the starts."""
    task, truth = load("reacher"), standin.hidden_params("reacher", "per-joint")
    root = tmp_path_factory.mktemp("starts")
    log = record(task, truth.model_copy(update={"obs_noise": 0.0}), 40, 0, root / "log.parquet",
                 standin.robot_id("reacher", "per-joint"))
    dataset = DatasetStore(root / "ds", task, "reacher").ingest([log], "test").dataset
    clean = Replayer(task, windows(task, dataset, CalibrateConfig(max_windows=64)), 2)
    start = clean.win.start.copy()
    cols = start_columns(clean)
    start[:, cols] += np.random.default_rng(1).normal(0, SIGMA, (len(start), len(cols)))
    return truth, clean, Replayer(task, clean.win.model_copy(update={"start": start}), 2)


def test_the_start_fit_moves_the_robots_hinge_joints_only():
    reacher, quadruped = load("reacher"), load("quadruped")
    assert start_columns(Replayer(reacher, _empty(reacher), 1)).tolist() == [1, 2, 5, 6]  # qpos 0-1, qvel 0-1
    cols = start_columns(Replayer(quadruped, _empty(quadruped), 1))
    m = quadruped.model
    assert len(cols) == 2 * (m.njnt - 1) and 1 + m.jnt_qposadr[0] not in cols  # the free root stays as logged


def _empty(task):
    from stages.twin.replay import Windows
    return Windows(start=np.zeros((0, 1)), control=np.zeros((1, 0, 1, task.model.nu)), target=np.zeros((0, 1, 1)),
                   episode=np.zeros(0, np.int64))


def test_profiled_starts_come_back_to_the_true_ones(clean_and_noisy):
    truth, clean, noisy = clean_and_noisy
    cols = start_columns(noisy)
    profile = Profile(noisy, truth)
    r, fitted = profile.fitted([truth])
    replay = noisy.residuals([truth])[0]
    assert r.shape == (1, *replay.shape[:1], replay.shape[1] + len(cols))  # the replay's, then the starts' ties
    logged_error = np.sqrt(((noisy.win.start - clean.win.start)[:, cols] ** 2).mean(axis=0))
    fitted_error = np.sqrt(((fitted[0] - clean.win.start)[:, cols] ** 2).mean(axis=0))
    assert logged_error == pytest.approx(np.full(4, SIGMA), rel=0.2)
    positions, velocities = slice(0, 2), slice(2, 4)
    assert (fitted_error[positions] < 0.4 * logged_error[positions]).all()
    # 0.002 rad/s moves a 20-step replay less than the logged value's own noise: velocities stay near it
    assert (fitted_error[velocities] < 1.1 * logged_error[velocities]).all()
    assert np.sqrt((r[0, :, : replay.shape[1]] ** 2).mean()) < 0.7 * np.sqrt((replay**2).mean())
    refit = Replayer(noisy.task, noisy.win.model_copy(update={"start": fitted[0]}), 2).residuals([truth])[0]
    linearised = r[0, :, : replay.shape[1]]  # the linearised step holds: replays from the fitted starts agree
    assert np.sqrt(((refit - linearised) ** 2).mean()) < 0.05 * np.sqrt((linearised**2).mean())


def test_each_problem_is_tied_to_its_own_logged_starts(clean_and_noisy):
    truth, clean, noisy = clean_and_noisy
    logged = np.stack([clean.win.start, noisy.win.start])
    r, fitted = Profile(clean, truth, logged=logged).fitted([truth, truth])
    np.testing.assert_allclose(fitted[0], clean.win.start, atol=1e-6)  # the clean problem's starts already fit
    assert np.abs(r[0]).max() < 1e-6 and np.abs(r[1]).max() > 1e-4


def test_a_config_leaves_fit_starts_and_joint_window_to_the_task_unless_it_sets_them():
    reacher, cartpole = load("reacher"), load("cartpole")
    default = CalibrateConfig()
    assert (default.for_task(reacher).fit_starts, default.for_task(reacher).joint_window) == (True, 46)
    assert (default.for_task(cartpole).fit_starts, default.for_task(cartpole).joint_window) == (False, None)
    own = CalibrateConfig(fit_starts=False, joint_window=30).for_task(reacher)
    assert (own.fit_starts, own.joint_window) == (False, 30)
    assert CalibrateConfig(fit_starts=True).for_task(cartpole).fit_starts is True


def test_steps_from_a_joint_limit_on_are_left_out(clean_and_noisy):
    truth, clean, _ = clean_and_noisy
    adr, low, high = limited_joints(clean.task)
    assert adr.tolist() == [1] and (low, high) == ([-3.0], [3.0])  # the elbow; the shoulder turns freely
    win = off_limits(clean.task, clean.win)
    margin = LIMIT_MARGIN * 6.0
    near = np.abs(clean.win.target[..., 1]) >= 3.0 - margin
    assert near.any() and 0 < win.mask[..., 1].mean() < 1
    assert (win.mask[..., 0] == 1).all()  # the shoulder's residuals all stay
    for w in range(len(near)):
        first = int(np.argmax(near[w])) if near[w].any() else near.shape[1]
        if abs(clean.win.start[w, 2]) >= 3.0 - margin:
            first = 0
        assert win.mask[w, :, 1].tolist() == [1.0] * first + [0.0] * (near.shape[1] - first), w
    masked = Replayer(clean.task, win, 2).residuals([truth.model_copy(update={"damping": 2.0})])[0]
    kept = win.mask.reshape(len(win.mask), -1) > 0  # (W, T · joints), as the residuals
    assert (masked[~kept] == 0).all() and np.abs(masked[kept]).max() > 0


@pytest.mark.slow  # about 60 s on 2 cores
def test_fitted_starts_on_long_windows_recover_the_small_friction(tmp_path):
    """5 minutes of logs, the reacher's default calibration: from the logged starts joint 0's friction (0.02 N m) came
    to 0.028, 0.024, 0.000 and 0.005 N m over four seeds; fitted with the starts on 46-step windows cut at the elbow's
    limit (the reacher's defaults), every per-joint value is within 10% (seed 0: frictions −3.5% and +5.2%) and each
    friction's interval holds its truth."""
    task, truth = load("reacher"), standin.hidden_params("reacher", "per-joint")
    log = record(task, truth, 300, 0, tmp_path / "log.parquet", standin.robot_id("reacher", "per-joint"))
    dataset = DatasetStore(tmp_path / "ds", task, "reacher").ingest([log], "test").dataset
    twin = calibrate(CalibrateConfig(), dataset, tmp_path / "twin")
    p = twin.params
    for j in ("joint0", "joint1"):
        for field, scale in (("damping_by_joint", p.damping), ("gain_by_actuator", p.actuator_gain),
                             ("friction_by_joint", 1.0)):
            got, want = scale * getattr(p, field)[j], getattr(truth, field)[j]
            assert got == pytest.approx(want, rel=0.1), (field, j, got)
        lo, hi = twin.intervals[f"friction_by_joint.{j}"]
        assert lo <= truth.friction_by_joint[j] <= hi, (j, lo, hi)
