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


def _policy(tmp_path, weight: float):
    from stages.artifacts import ExportedPolicy
    from tests.bundles import tiny_onnx

    path = tmp_path / f"w{weight}.onnx"
    path.write_bytes(tiny_onnx(weight))
    return ExportedPolicy(path=path, digest=str(weight), task="cartpole", opset=17, parity_max_abs_error=0.0, golden=path)


def test_challenger_is_compared_with_the_champion_on_the_same_seeds(tmp_path):
    from stages.artifacts import TwinSpec
    from stages.sim.params import PhysicalParams
    from stages.twin.evaluate import Champion, EvalConfig, evaluate

    twin = TwinSpec(path=tmp_path / "twin.json", digest="t", task="cartpole", params=PhysicalParams(), uncertainty={},
                    dataset_digest="d", replay_error_before=1.0, replay_error_after=1.0)
    gate = GateConfig(min_success_rate=0.0, min_mean_return=-1e9, non_inferiority_margin=0.0)
    cfg = EvalConfig(episodes=16, seed=5)
    a, b = _policy(tmp_path, 0.0), _policy(tmp_path, -0.5)  # mean returns about 34 and 13
    same = evaluate(cfg, gate, a, twin, tmp_path / "same", Champion(version="1", onnx=a.path))
    assert same.passed and same.champion_mean_return == same.mean_return  # identical seeds: a zero difference
    ra = evaluate(cfg, gate, a, twin, tmp_path / "a").mean_return
    rb = evaluate(cfg, gate, b, twin, tmp_path / "b").mean_return
    assert ra != rb
    better, worse = (a, b) if ra > rb else (b, a)
    assert evaluate(cfg, gate, better, twin, tmp_path / "up", Champion(version="1", onnx=worse.path)).passed
    down = evaluate(cfg, gate, worse, twin, tmp_path / "down", Champion(version="1", onnx=better.path))
    assert not down.passed and down.reasons[-1].startswith("FAIL: vs champion, paired return difference")
