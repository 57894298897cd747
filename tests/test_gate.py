"""Gate statistics: floors apply to interval lower bounds."""

from __future__ import annotations

import numpy as np
import pytest

from stages.twin.gate import GateConfig, floor_checks, suite_checks
from stages.twin.stats import bootstrap_mean, wilson


def test_wilson_interval_known_values():
    low, high = wilson(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-3) and high == pytest.approx(0.9433, abs=1e-3)
    assert wilson(32, 32)[0] == pytest.approx(0.8928, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_few_lucky_episodes_do_not_pass():
    lucky = floor_checks("nominal", wilson(4, 4)[0], 0.8, 200.0, None)  # 4/4 successes: lower bound 0.51
    assert not lucky[0].passed and lucky[0].reason().startswith("FAIL: nominal: success rate lower 95% bound")
    assert floor_checks("nominal", wilson(32, 32)[0], 0.8, 200.0, 150.0)[0].passed
    assert not floor_checks("nominal", 1.0, 0.8, 140.0, 150.0)[1].passed


def test_bootstrap_interval_brackets_the_mean_and_is_seeded():
    x = np.random.default_rng(0).normal(100, 10, 64)
    low, high = bootstrap_mean(x, seed=3)
    assert low < x.mean() < high and high - low < 10
    assert bootstrap_mean(x, seed=3) == (low, high)


def test_safety_ceilings_and_latency_budget_fail_the_gate():
    ok = dict(nan_actions=0, limit_fraction=0.0, saturation=0.1, latency_p99_ms=1.0, period_s=0.02, paired_low=None)
    assert all(c.passed for c in suite_checks(GateConfig(), **ok))
    for field, bad, name in (("nan_actions", 1, "NaN/Inf actions"), ("limit_fraction", 0.5, "steps at a joint limit"),
                             ("saturation", 0.99, "actuator saturation"), ("latency_p99_ms", 25.0, "in-loop latency p99")):
        failed = [c for c in suite_checks(GateConfig(), **{**ok, field: bad}) if not c.passed]
        assert [c.name for c in failed] == [name]


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

    twin = TwinSpec(path=tmp_path / "twin.json", digest="t", task="cartpole", params=PhysicalParams(),
                    dataset_digest="d", replay_error_before=1.0, replay_error_after=1.0)
    gate = GateConfig(min_success_rate=0.0, min_mean_return=-1e9, non_inferiority_margin=0.0)
    suite = tmp_path / "suite.yaml"
    suite.write_text("episodes: 16\nscenarios:\n  - name: nominal\n  - name: pushes\n    disturbance: {push: 0.3}\n")
    cfg = EvalConfig(seed=5, suite=suite, video=False)
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
