"""Sensors in the calibration residual: the quadruped's IMU readings (``Term.sensor``) beside its joint positions."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from stages import standin
from stages.collect.ingest import StandinConfig, record_standin
from stages.collect.store import DatasetStore
from stages.sim.registry import load
from stages.twin.calibrate import CalibrateConfig, calibrate
from stages.twin.replay import Replayer, windows

IMU = {"imu_gyro": 0.1, "imu_velocity": 0.1}


@pytest.fixture(scope="module")
def quadruped_logs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imu")
    task = load("quadruped")
    return task, record_standin(DatasetStore(tmp / "ds", task, "quadruped"), StandinConfig(episodes=4), tmp / "up").dataset


def test_sensor_readings_line_up_with_the_replayed_step(quadruped_logs):
    """A log's row t holds the readings of the period before tick t: row s+j+1 matches the replay's step j far better
    than the rows around it, at the stand-in's hidden truth."""
    task, ds = quadruped_logs
    win = windows(task, ds, CalibrateConfig(max_windows=32, window=8, sensors={"imu_gyro": 1.0}))
    assert win.sensor_target.shape == (32, 8, 3) and win.sensor_names == ("imu_gyro",) * 3
    replayed = Replayer(task, win, 2).rollout([standin.hidden_params("quadruped")])[1][0][..., win.sensor_index]
    rms = {off: np.sqrt(((replayed[:, 2:6] - win.sensor_target[:, 2 + off : 6 + off]) ** 2).mean()) for off in (-1, 0, 1)}
    assert 3 * rms[0] < min(rms[-1], rms[1]), rms


def test_weighted_sensor_residuals_follow_the_joints(quadruped_logs):
    task, ds = quadruped_logs
    truth, prior = standin.hidden_params("quadruped"), task.nominal_params().model_copy(update={"latency_steps": 1})
    plain = Replayer(task, windows(task, ds, CalibrateConfig(max_windows=16)), 2)
    single, double = (Replayer(task, windows(task, ds, CalibrateConfig(max_windows=16, sensors={k: w * v for k, v in IMU.items()})), 2)
                      for w in (1, 2))
    r0, r1, r2 = (r.residuals([truth]).reshape(16, 20, -1) for r in (plain, single, double))
    assert single.width == 12 + 6 and r1.shape[-1] == 18
    np.testing.assert_array_equal(r1[..., :12], r0)
    np.testing.assert_allclose(r2[..., 12:], 2 * r1[..., 12:])
    # the IMU carries what the joints do not: the base's motion; the truth replays it closer than the prior
    at_truth, at_prior = single.sensor_errors(truth), single.sensor_errors(prior)
    assert all(at_truth[k] < 0.7 * at_prior[k] for k in IMU), (at_truth, at_prior)


def test_a_sensor_no_term_reads_is_refused_naming_it(quadruped_logs):
    task, ds = quadruped_logs
    for name in ("imu_orientation", "imu_accelerometer"):  # read but not verbatim (gravity), and not in the MJCF
        with pytest.raises(ValueError, match=rf"calibrate: sensors: task 'quadruped' has no observation terms that "
                                             rf"read sensor '{name}' \(Term.sensor\); these do: \['imu_gyro', 'imu_velocity'\]"):
            windows(task, ds, CalibrateConfig(sensors={name: 1.0}))
    for weight in (0.0, -1.0, float("nan")):
        with pytest.raises(ValidationError, match="sensors.imu_gyro"):
            CalibrateConfig(sensors={"imu_gyro": weight})


def test_the_twin_records_each_sensor_of_its_residual(quadruped_logs, tmp_path):
    task, ds = quadruped_logs
    cfg = CalibrateConfig(max_windows=8, generations=4, search_generations=2, max_latency=0, joint_steps=0,
                          bootstrap=20, sensors=IMU)
    twin = calibrate(cfg, ds, tmp_path / "twin")
    sensors = json.loads(twin.path.read_text())["sensors"]
    assert set(sensors) == set(IMU)
    for name, record in sensors.items():
        assert record["weight"] == IMU[name] and record["replay_error_after"] < record["replay_error_before"], record
