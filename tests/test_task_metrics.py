"""Task metrics: the quadruped's velocity-tracking error, reported with an interval and bounded by the gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flows.params import PipelineParams
from stages.artifacts import ExportedPolicy, TwinSpec
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.sim.task import Metric
from stages.twin.evaluate import EvalConfig, evaluate
from stages.twin.gate import GateConfig, metric_checks
from tests.test_quadruped import constant_onnx

SUITE = """episodes: 4
scenarios:
  - name: nominal
  - name: payload+25%
    scale: {mass: 1.25}
    metric_limits: {velocity_error: 10.0}
"""


@pytest.fixture(scope="module")
def quad():
    return load("quadruped")


def yawed_state(quad, yaw: float, body_velocity: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """One standing state headed ``yaw`` (rad) whose base moves at ``body_velocity`` (m/s, body frame x, y)."""
    qpos, qvel = quad.reference_qpos[None].copy(), np.zeros((1, quad.model.nv))
    qpos[0, 3:7] = [np.cos(yaw / 2), 0, 0, np.sin(yaw / 2)]
    vx, vy = body_velocity
    qvel[0, :2] = [vx * np.cos(yaw) - vy * np.sin(yaw), vx * np.sin(yaw) + vy * np.cos(yaw)]  # to the world frame
    return qpos, qvel


def velocity_error(quad, qpos, qvel, command) -> float:
    sensor = quad.readings(quad.sensordata_at(qpos, qvel))
    return float(quad.step_metrics(qpos, qvel, command=np.array([command]), sensor=sensor)["velocity_error"][0])


def test_velocity_error_is_the_planar_body_frame_mismatch(quad):
    assert [m.name for m in quad.metrics] == ["velocity_error"] and quad.metrics[0].better == "lower"
    qpos, qvel = yawed_state(quad, np.pi / 2, (0.5, 0.2))
    assert velocity_error(quad, qpos, qvel, (0.5, 0.2, 0.7)) == pytest.approx(0, abs=1e-9)  # yaw rate is not in it
    qpos, qvel = yawed_state(quad, 0.3, (0.0, 0.0))
    assert velocity_error(quad, qpos, qvel, (0.3, -0.4, 0.0)) == pytest.approx(0.5)


def test_a_metric_floor_uses_the_lower_bound():
    grip = Metric("grip", "1", better="higher")
    assert metric_checks("nominal", (grip,), {"grip": (0.6, 0.9)}, {"grip": 0.5})[0].passed
    fail = metric_checks("nominal", (grip,), {"grip": (0.4, 0.9)}, {"grip": 0.5})[0]
    assert not fail.passed and fail.name == "nominal: grip lower 95% bound"


def standing(quad, tmp_path: Path) -> ExportedPolicy:
    onnx = constant_onnx(tmp_path / "stand.onnx", quad.action_default)
    return ExportedPolicy(path=onnx, digest="stand" * 4, task="quadruped", opset=17, parity_max_abs_error=0.0,
                          golden=onnx)


def twin() -> TwinSpec:
    return TwinSpec(path=Path("twin.json"), digest="twin" * 4, task="quadruped", params=PhysicalParams(),
                    dataset_digest="d", standin_truth=None, replay_error_before=1.0, replay_error_after=1.0)


def test_evaluation_reports_the_metric_and_the_gate_bounds_it(quad, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    gate = GateConfig(min_success_rate=0.0, metric_limits={"velocity_error": 0.05})
    report = evaluate(EvalConfig(suite=suite, video=False), gate, standing(quad, tmp_path), twin(), tmp_path / "eval")
    data = json.loads(report.path.read_text())
    assert data["metrics"] == [{"name": "velocity_error", "unit": "m/s", "better": "lower"}]
    for row in data["scenarios"]:
        m = row["metrics"]["velocity_error"]
        assert m["ci95"][0] <= m["mean"] <= m["ci95"][1] and 0.2 < m["mean"] < 1.2  # standing still: ≈ |command|
    checks = {c["name"]: c for c in data["checks"]}
    assert not checks["nominal: velocity_error upper 95% bound"]["passed"]  # the gate's 0.05 m/s
    assert checks["payload+25%: velocity_error upper 95% bound"]["passed"]  # the scenario's own 10 m/s
    assert report.scenarios[0].metrics == {"velocity_error": data["scenarios"][0]["metrics"]["velocity_error"]["mean"]}
    assert not report.passed and any(r.startswith("FAIL: nominal: velocity_error") for r in report.reasons)
    assert "velocity_error (m/s, 95% CI)" in report.html.read_text()


@pytest.mark.parametrize("task", ["quadruped", "cartpole"])
def test_an_unknown_metric_is_refused_in_one_line(quad, tmp_path, task):
    policy = standing(quad, tmp_path).model_copy(update={"task": task})
    with pytest.raises(ValueError) as e:
        evaluate(EvalConfig(video=False), GateConfig(metric_limits={"speed": 1.0}), policy, twin(), tmp_path / "eval")
    known = "['velocity_error']" if task == "quadruped" else "none"
    assert str(e.value) == f"gate metric limit 'speed': task {task!r} has no such metric (its metrics: {known})"


def test_a_pipeline_refuses_an_unknown_metric_before_it_runs():
    PipelineParams(task="quadruped", gate=GateConfig(metric_limits={"velocity_error": 0.25}))
    with pytest.raises(ValueError, match=r"gate metric limit 'speed': task 'cartpole' has no such metric"):
        PipelineParams(task="cartpole", gate=GateConfig(metric_limits={"speed": 1.0}))
