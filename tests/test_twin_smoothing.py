"""Replay start states smoothed over neighbouring samples (issue 33): the filter keeps the motion, lowers the noise
by the factor calibration's noise estimate assumes, and stays inside each episode."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from flows.params import CalibrateSettings
from stages.sim.registry import load
from stages.twin.calibration_config import CalibrateConfig
from stages.twin.replay import smoothed, smoothing_noise


def test_a_quadratic_motion_passes_unchanged_and_white_noise_shrinks_by_the_stated_factor():
    t = np.arange(400, dtype=float)[:, None]
    motion = 0.3 + 0.01 * t - 2e-5 * t**2
    bounds = np.array([0, 400])
    np.testing.assert_allclose(smoothed(motion, bounds, 5), motion, atol=1e-12)
    noise = np.random.default_rng(0).normal(0, 1.0, (200_000, 1))
    ratio = smoothed(noise, np.array([0, len(noise)]), 5).std() / noise.std()
    assert ratio == pytest.approx(smoothing_noise(5), rel=0.01) and ratio < 0.75
    assert smoothing_noise(1) == 1.0 and smoothed(noise, np.array([0, len(noise)]), 1) is noise


def test_episodes_are_smoothed_apart_and_a_short_one_stays_raw():
    """A step between two episodes is not smeared across the boundary; an episode shorter than the window is raw."""
    values = np.r_[np.zeros(10), np.ones(10), np.full(3, 5.0)][:, None]
    out = smoothed(values, np.array([0, 10, 20, 23]), 5)
    np.testing.assert_allclose(out, values, atol=1e-12)
    assert smoothed(values, np.array([0, 23]), 5)[9, 0] != 0.0  # one episode: the filter does cross the step


def test_the_window_must_be_odd_and_defaults_to_the_task():
    for bad in (4, 3, 0):
        with pytest.raises(ValidationError, match="start_smoothing must be 1 or an odd window"):
            CalibrateConfig(start_smoothing=bad)
        with pytest.raises(ValidationError, match="start_smoothing must be 1 or an odd window"):
            CalibrateSettings(start_smoothing=bad)  # the pipeline's settings refuse it before any stage runs
    assert CalibrateConfig().start_smoothing is None
    assert load("quadruped").start_smoothing == 5 and load("reacher").start_smoothing == 1
