"""Stand-in profiles of arm6 and the quadruped: calibration from the stand-in's logs recovers what each robot reveals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages import logs, standin
from stages.collect.ingest import StandinConfig, record_standin
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore
from stages.sim.registry import load
from stages.twin.search import FITTED
from stages.twin.calibrate import CalibrateConfig, calibrate


@pytest.mark.parametrize("task", ["arm6", "quadruped"])
def test_arm6_and_quadruped_have_their_own_hidden_shifts(task):
    truth, generic = standin.hidden_params(task), standin.hidden_params("no-such-task")
    assert truth != generic and truth.latency_steps == 1 and truth.obs_noise > 0
    assert all(getattr(truth, name) != getattr(load(task).nominal_params(), name) for name in FITTED)


def test_excitation_amplitude_reaches_the_recorded_actions(tmp_path):
    """The excitation's std before its ±1 clip is the task's ``excitation_scale`` unless the recording overrides it;
    the same draws are scaled, so cart-pole's default (1.0) logs are what they were before the setting existed."""
    task, truth = load("cartpole"), standin.hidden_params("cartpole")

    def actions(**kw) -> np.ndarray:
        return logs.columns(logs.read(record(task, truth, 8, 0, tmp_path / f"{kw}.parquet", "s", **kw)), "act")

    full, gentle = actions(), actions(amplitude=0.3)
    assert task.excitation_scale == 1.0 and np.array_equal(full, actions(amplitude=1.0))
    inside = np.abs(full) < 1
    np.testing.assert_allclose(gentle[inside], 0.3 * full[inside], atol=1e-6)
    assert gentle.std() == pytest.approx(0.3, rel=0.15) and (np.abs(gentle) >= 1).mean() < 0.01 < (~inside).mean()


@pytest.mark.parametrize("amplitude", [None, 1.0])
def test_arm6_standin_is_excited_at_its_task_scale_unless_overridden(amplitude, tmp_path):
    task = load("arm6")
    record_standin(DatasetStore(tmp_path / "ds", task, "arm6"), StandinConfig(episodes=4, amplitude=amplitude),
                   tmp_path / "up")
    act = logs.columns(logs.read(next((tmp_path / "up").glob("*.parquet"))), "act")
    scale = amplitude or task.excitation_scale
    clipped_std = np.clip(scale * np.random.default_rng(0).standard_normal(10**6), -1, 1).std()
    assert task.excitation_scale < 1 and act.std() == pytest.approx(clipped_std, rel=0.15)


def assert_closer_than_the_prior(twin, truth, names, factor: float) -> None:
    """Each fitted value ``factor`` times closer to the truth than the prior (the uncalibrated model) is: a fit that
    stays at the prior fails even when the prior lies within the tolerance of the truth."""
    nominal = load(twin.task).nominal_params()  # calibration's prior
    for name in names:
        fitted, prior, true = getattr(twin.params, name), getattr(nominal, name), getattr(truth, name)
        assert factor * abs(fitted - true) < abs(prior - true), (name, fitted, prior, true)


def calibrated_standin(task: str, episodes: int, cfg: CalibrateConfig, tmp_path):
    """The twin calibrated from ``episodes`` of the stand-in's logs for ``task``, and the stand-in's hidden truth."""
    store = DatasetStore(tmp_path / "ds", load(task), task)
    ds = record_standin(store, StandinConfig(episodes=episodes), tmp_path / "uploads").dataset
    return calibrate(cfg, ds, tmp_path / "twin"), standin.hidden_params(task)


@pytest.mark.slow  # about 90 s on 2 cores
def test_arm6_calibration_recovers_every_hidden_parameter(tmp_path):
    """Gravity loads every link and the wrist's armature dominates its links' inertia: all four separate."""
    # friction moves the replay error least: it needs ~70 generations to settle (40 leave it ~20% low)
    twin, truth = calibrated_standin(
        "arm6", 24, CalibrateConfig(max_windows=96, generations=70, search_generations=6, max_latency=1), tmp_path)
    assert twin.unidentified == () and twin.params.latency_steps == truth.latency_steps
    for name in FITTED:
        assert getattr(twin.params, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert_closer_than_the_prior(twin, truth, FITTED, factor=5)
    assert twin.params.obs_noise == pytest.approx(truth.obs_noise, rel=0.3)
    assert twin.replay_error_after * 20 < twin.replay_error_before


@pytest.fixture(scope="module")  # about 170 s on 2 cores: the quadruped's tests run with `make test-slow`
def quadruped_twin(tmp_path_factory):
    """Replays start from states smoothed over 5 samples (the quadruped's ``start_smoothing``): from raw ones, the
    2 mm noise in body height moves the foot contacts and biases gain, payload and friction beyond their intervals."""
    return calibrated_standin("quadruped", 8, CalibrateConfig(max_windows=64, generations=30, search_generations=6,
                                                              max_latency=1), tmp_path_factory.mktemp("quadruped"))


@pytest.mark.slow
def test_quadruped_calibration_recovers_gain_damping_and_payload(quadruped_twin):
    twin, truth = quadruped_twin
    assert twin.params.latency_steps == truth.latency_steps
    for name in ("damping", "actuator_gain", "mass"):
        assert getattr(twin.params, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    # payload 1.233 against 1.15 (prior 1.0): 1.8× closer; contacts blur mass more than the servos' gain and damping
    assert_closer_than_the_prior(twin, truth, ("damping", "actuator_gain", "mass"), factor=1.5)
    assert twin.replay_error_after * 10 < twin.replay_error_before
    assert json.loads(twin.path.read_text())["start_smoothing"] == 5


@pytest.mark.slow
def test_quadruped_intervals_hold_gain_damping_and_payload(quadruped_twin):
    twin, truth = quadruped_twin
    for name in ("damping", "actuator_gain", "mass"):
        lo, hi = twin.intervals[name]
        assert lo <= getattr(truth, name) <= hi and hi - lo < 0.4 * getattr(twin.params, name), (name, lo, hi)


@pytest.mark.slow
def test_quadruped_friction_is_within_its_interval(quadruped_twin):
    """0.08 N m of leg friction is 0.3% of the servo torques: contact-rich 0.4 s replays hardly resolve it, so the
    twin must either fit it or say how little it knows."""
    twin, truth = quadruped_twin
    lo, hi = twin.intervals["friction"]
    assert lo <= truth.friction <= hi, (twin.params.friction, lo, hi)

@pytest.mark.slow  # 110-187 s on 2 loaded cores
def test_arm6_per_joint_intervals_hold_the_truth(tmp_path):
    """Issue 33 on arm6's per-joint stand-in: the global pass cannot represent per-joint damping, so its friction
    stands in for it (~6 N m for truths of 0.34-0.67 N m); the per-joint pass must come back down from there (it used
    to end at 1.5-12 N m, damping 10-25% low, 8 of 24 intervals holding) and body masses get intervals though the
    global mass is unidentified. Under arm6's excitation scale (0.5) every joint value's interval holds on these 12
    episodes; under the full excitation (1.0) shoulder-lift friction, the joint gravity loads most, was fitted 0.28 N m
    low and missed. With 24 episodes all 24 hold, link masses included (benchmarks/calibrate_arm6_per_joint.py)."""
    task, truth = load("arm6"), standin.hidden_params("arm6", "per-joint")
    log = record(task, truth, 12, 0, tmp_path / "log.parquet", standin.robot_id("arm6", "per-joint"))
    ds = DatasetStore(tmp_path / "ds", task, "arm6").ingest([log], "test").dataset
    twin = calibrate(CalibrateConfig(max_windows=48, generations=30, search_generations=6, max_latency=1,
                                     body_masses=True, bootstrap=100), ds, tmp_path / "twin")
    p, missed = twin.params, []
    for field, scale in (("damping_by_joint", "damping"), ("gain_by_actuator", "actuator_gain"),
                         ("friction_by_joint", None)):
        for j, true in getattr(truth, field).items():
            lo, hi = twin.intervals[f"{field}.{j}"]
            s_fit, s_true = (getattr(p, scale), getattr(truth, scale)) if scale else (1.0, 1.0)
            if not s_fit * lo <= s_true * true <= s_fit * hi:
                missed.append(f"{field}.{j}")
            if scale:
                assert s_fit * getattr(p, field)[j] == pytest.approx(s_true * true, rel=0.02), (field, j)
            else:
                assert abs(p.friction_by_joint[j] - true) < 0.3, (j, p.friction_by_joint[j], true)
    assert not missed, missed
    assert {f"mass_by_body.{b}" for b in task.mass_bodies} <= set(twin.intervals)
    assert twin.misfit.worst_joints == () and twin.misfit.ratio < 1.5
