"""Stand-in profiles of arm6 and the quadruped: calibration from the stand-in's logs recovers what each robot reveals."""

from __future__ import annotations

import json

import pytest

from stages import standin
from stages.collect.ingest import StandinConfig, record_standin
from stages.collect.store import DatasetStore
from stages.sim.registry import load
from stages.twin.search import FITTED
from stages.twin.calibrate import CalibrateConfig, calibrate


@pytest.mark.parametrize("task", ["arm6", "quadruped"])
def test_arm6_and_quadruped_have_their_own_hidden_shifts(task):
    truth, generic = standin.hidden_params(task), standin.hidden_params("no-such-task")
    assert truth != generic and truth.latency_steps == 1 and truth.obs_noise > 0
    assert all(getattr(truth, name) != getattr(load(task).nominal_params(), name) for name in FITTED)


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