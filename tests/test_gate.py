"""Gate statistics: floors apply to interval lower bounds."""

from __future__ import annotations

import numpy as np
import pytest

from stages.twin.gate import GateConfig, decide
from stages.twin.stats import bootstrap_mean, wilson


def test_wilson_interval_known_values():
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-3) and high == pytest.approx(0.9433, abs=1e-3)
    assert wilson(32, 32)[0] == pytest.approx(0.8928, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_few_lucky_episodes_do_not_pass():
    gate = GateConfig(min_success_rate=0.8)
    passed, reasons = decide(gate, wilson(4, 4)[0], 200.0, 0)  # 4/4 successes: lower bound 0.51
    assert not passed and reasons[0].startswith("FAIL: success rate lower 95% bound")
    assert decide(gate, wilson(32, 32)[0], 200.0, 0)[0]


def test_bootstrap_interval_brackets_the_mean_and_is_seeded():
    x = np.random.default_rng(0).normal(100, 10, 64)
    low, high = bootstrap_mean(x, seed=3)
    assert low < x.mean() < high and high - low < 10
    assert bootstrap_mean(x, seed=3) == (low, high)


def test_nan_actions_fail_the_gate():
    passed, reasons = decide(GateConfig(), 0.95, 240.0, nan_actions=1)
    assert not passed and reasons[2].startswith("FAIL: NaN actions")
