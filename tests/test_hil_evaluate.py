"""``sim2edge evaluate --hil``: a real signed bundle served by a real ``sim2edge-agent run``, the CLI as a user runs it.

The device and the bundle are tests/test_hil.py's linear cart-pole balancer (one slow test: a PPO policy trained
with latency randomization); episodes are cut to 60 steps (100 behind the 10 ms links).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.export import ExportConfig, export
from stages.sim.cartpole import CartPole
from stages.sim.params import Randomization
from stages.sim.task import Metric
from stages.train import train
from stages.train_config import TrainConfig
from stages.twin.hil_evaluate import HilGateConfig, HilSuiteConfig, hil_checks, hil_evaluate
from stages.twin.report import write_hil
from stages.twin.relay import Impairment, Relay
from tests.test_evaluate import LATENCY_FRAGILE
from tests.test_hil import SEED, STEPS, cartpole_store, serve, stop

LINK = Impairment(delay_s=0.01, jitter_s=0.003)
"""The issue's link: 10 ms ± 3 ms each way, a round trip of about the 20 ms period."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(bundle, trusted key, device address, workspace) with the agent serving the bundle."""
    tmp = tmp_path_factory.mktemp("hil-evaluate")
    root, _ = cartpole_store(tmp)
    proc, address = serve(root, "udp://127.0.0.1:0")
    (tmp / "home").mkdir()  # the workspace (sim2edge up makes it)
    yield tmp / "b.tar", tmp / "k.pub", address, tmp
    stop(proc)


def evaluate(served, device: str, *extra: str, steps: int = STEPS):
    bundle, pub, _, tmp = served
    args = ["evaluate", "--bundle", str(bundle), "--trust", str(pub), "--hil", device, "--episodes", "2",
            "--max-steps", str(steps), "--seed", str(SEED), *extra]
    return CliRunner().invoke(app, args, env={"SIM2EDGE_HOME": str(tmp / "home"), "COLUMNS": "220"})


def test_clean_link_passes_the_hil_floors_beside_in_process(served, tmp_path):
    out = tmp_path / "hil.json"
    done = evaluate(served, served[2], "--scenario", "nominal", "--scenario", "gain-15%", "--out", str(out))
    assert done.exit_code == 0, done.output
    assert "HIL gate pass 4/4" in done.output and "gain-15%" in done.output and "damping" not in done.output
    doc = json.loads(out.read_text())
    assert doc["passed"] and [r["scenario"] for r in doc["scenarios"]] == ["nominal", "gain-15%"]
    assert doc["device_runtime"] == "onnxruntime (CPUExecutionProvider)"  # the agent's own statistics name it
    page = out.with_suffix(".html").read_text()  # the same side by side, as HTML
    assert "<span id=verdict>PASSED</span>" in page and "<td>gain-15%</td>" in page
    for r in doc["scenarios"]:
        base, hil = r["in_process"], r["hil"]
        assert hil["episodes"] == 2 and hil["steps"] == 2 * STEPS and hil["falls"] == base["falls"] == 0
        assert hil["mean_return"] == pytest.approx(base["mean_return"], rel=0.05)
        assert hil["deadline_misses"] == hil["late_actions"] + hil["lost_actions"]
        assert hil["rtt_ms_p50"] <= hil["rtt_ms_p99"] <= hil["rtt_ms_max"]
        assert r["device"]["observations"] >= hil["steps"]  # the device's own counters, grown over the scenario
    assert doc["round_trip_ms_p99"] < doc["period_s"] * 1e3 and doc["paired_difference_ci95"][0] > -1.0


@dataclass(frozen=True)
class MeasuredCartPole(CartPole):
    """The cart-pole with an episode metric: how far the pole leans."""

    metrics: tuple[Metric, ...] = (Metric("pole_lean", "rad"),)

    def step_metrics(self, qpos: np.ndarray, qvel: np.ndarray, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {"pole_lean": np.abs(qpos[:, 1])}


def test_task_metrics_are_reported_and_gated_over_hil_beside_in_process(served, tmp_path):
    bundle, _, address, tmp = served
    cfg = HilSuiteConfig(devices=(address,), episodes=2, seed=SEED, max_steps=STEPS, scenarios=("nominal",))
    task = f"{__name__}:MeasuredCartPole"
    with pytest.raises(ValueError, match="gate metric limit 'lean'.*no such metric.*pole_lean"):  # before any device
        hil_evaluate(cfg, HilGateConfig(metric_limits={"lean": 0.2}), tmp / "policy.onnx", task)
    report = hil_evaluate(cfg, HilGateConfig(metric_limits={"pole_lean": 0.2}), tmp / "policy.onnx", task)
    (row,) = report.scenarios
    base, hil = row["in_process"]["metrics"]["pole_lean"], row["hil"]["metrics"]["pole_lean"]
    for m in (base, hil):
        assert 0 < m["mean"] < 0.2 and m["ci95"][0] <= m["mean"] <= m["ci95"][1]
    assert hil["mean"] == pytest.approx(base["mean"], rel=0.3)  # the same seeds, the same balancer, a clean link
    (lean,) = [c for c in report.checks if "pole_lean" in c.name]
    assert lean.name == "nominal: HIL: pole_lean upper 95% bound" and lean.passed, lean
    tight = HilGateConfig(metric_limits={"pole_lean": hil["ci95"][1] * 0.9})  # the upper bound, not the mean
    checks = hil_checks(tight, list(report.scenarios), cfg.select(task), MeasuredCartPole().metrics,
                        report.round_trip_ms_p99, report.period_s, report.paired_difference_ci95[0])
    assert [c.passed for c in checks if "pole_lean" in c.name] == [False]
    page = write_hil(json.loads(report.to_json()), tmp_path / "hil.html").read_text()
    assert "pole_lean in-process (95%)" in page and "pole_lean HIL (95%)" in page and f"{hil['mean']:.3f}" in page


def test_delay_beyond_the_period_fails_the_hil_gate_naming_the_clauses(served, tmp_path):
    with Relay(served[2], Impairment(delay_s=0.025), Impairment(), seed=1) as relay:
        done = evaluate(served, relay.address, "--scenario", "nominal", "--out", str(tmp_path / "hil.json"))
    assert done.exit_code == 1, done.output
    verdict = next(line for line in done.output.splitlines() if line.startswith("HIL gate "))
    assert verdict.startswith("HIL gate FAIL 2/3: "), verdict
    assert "nominal HIL deadline-miss fraction" in verdict and "HIL round-trip p99" in verdict
    assert "paired return" not in verdict  # the balancer survives a late action: only the failing clauses are named
    assert not json.loads((tmp_path / "hil.json").read_text())["passed"]


def test_gate_floors_come_from_a_file(served, tmp_path):
    strict = tmp_path / "gate.yaml"
    strict.write_text("max_round_trip_fraction: 0.01\n")
    done = evaluate(served, served[2], "--scenario", "nominal", "--hil-gate", str(strict), "--out", str(tmp_path / "r.json"))
    assert done.exit_code == 1 and "HIL gate FAIL 1/3: HIL round-trip p99" in done.output, done.output
    strict.write_text("max_misses: 3\n")
    done = evaluate(served, served[2], "--hil-gate", str(strict))
    assert done.exit_code == 2 and "max_misses: Extra inputs are not permitted" in done.output, done.output


def test_latency_fragile_policy_fails_on_returns_behind_a_period_of_round_trip(tmp_path):
    """tests/test_evaluate.py's fragile balancer, 10 ms each way: it falls over HIL, not in-process."""
    root, _ = cartpole_store(tmp_path, LATENCY_FRAGILE)
    (tmp_path / "home").mkdir()
    proc, address = serve(root, "udp://127.0.0.1:0")
    try:
        with Relay(address, Impairment(delay_s=0.01), seed=2) as relay:
            done = evaluate((tmp_path / "b.tar", tmp_path / "k.pub", address, tmp_path), relay.address,
                            "--scenario", "nominal", "--out", str(tmp_path / "hil.json"), steps=100)
    finally:
        stop(proc)
    assert done.exit_code == 1, done.output
    verdict = next(line for line in done.output.splitlines() if line.startswith("HIL gate FAIL"))
    assert "HIL vs in-process paired return difference" in verdict, verdict
    row = json.loads((tmp_path / "hil.json").read_text())["scenarios"][0]
    assert row["in_process"]["falls"] == 0 and row["hil"]["falls"] > 0, row


@dataclass(frozen=True)
class LatencyRandomizedCartPole(CartPole):
    """Cart-pole whose training samples 0, 1 or 2 control steps (0–40 ms) of action latency per episode."""

    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.3, actuator_gain=0.15,
                                                                                mass=0.2, latency_steps=2))


def behind_link(tmp_path: Path, **store) -> tuple[str, dict]:
    """``sim2edge evaluate --hil`` (nominal, 2 × 100 steps) of ``cartpole_store(tmp_path, **store)`` served by a real
    agent behind :data:`LINK`: (the verdict line, the scenario's row)."""
    (tmp_path / "home").mkdir(parents=True)
    root, _ = cartpole_store(tmp_path, **store)
    proc, address = serve(root, "udp://127.0.0.1:0")
    try:
        with Relay(address, LINK, seed=2) as relay:
            done = evaluate((tmp_path / "b.tar", tmp_path / "k.pub", address, tmp_path), relay.address,
                            "--scenario", "nominal", "--out", str(tmp_path / "hil.json"), steps=100)
    finally:
        stop(proc)
    verdict = next((line for line in done.output.splitlines() if line.startswith("HIL gate ")), done.output)
    return verdict, json.loads((tmp_path / "hil.json").read_text())["scenarios"][0]


@pytest.mark.slow
def test_policy_trained_with_latency_randomization_keeps_its_returns_where_the_fragile_one_falls(tmp_path):
    """PPO with 0–2 steps of action latency per episode, exported to ONNX, behind the link that fells the fragile
    balancer: no fall, and the paired-return clause passes. The link's own clauses (deadline misses, round-trip p99)
    fail for any policy here: a ~20 ms round trip is the period, whatever the device serves."""
    cfg = TrainConfig(task=f"{__name__}:LatencyRandomizedCartPole", iterations=80, num_envs=64, steps_per_env=32,
                      hidden_dims=(32, 32))
    checkpoint = train(cfg, LatencyRandomizedCartPole().nominal_params(), tmp_path / "train")
    exported = export(ExportConfig(), checkpoint, tmp_path / "export")
    fragile_verdict, fragile = behind_link(tmp_path / "fragile", k=LATENCY_FRAGILE)
    verdict, row = behind_link(tmp_path / "trained", exported=exported)
    assert "HIL vs in-process paired return difference" in fragile_verdict and fragile["hil"]["falls"] > 0, fragile
    assert verdict.startswith("HIL gate FAIL 2/3: "), verdict
    assert "paired return" not in verdict and "HIL round-trip p99" in verdict, verdict
    assert row["in_process"]["falls"] == row["hil"]["falls"] == 0, row
    assert row["hil"]["mean_return"] >= row["in_process"]["mean_return"] - 10, row


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:9", "udp://127.0.0.1:port", "udp://:9", "unix://"])
def test_a_bad_address_is_refused_in_one_line(served, address):
    done = evaluate(served, address)
    assert done.exit_code == 2 and isinstance(done.exception, (SystemExit, type(None))), done.output
    assert done.output.strip().count("\n") == 0 and address in done.output and "Traceback" not in done.output


def test_an_unknown_scenario_is_refused_naming_it(served):
    done = evaluate(served, served[2], "--scenario", "nope")
    assert done.exit_code == 2 and "'nope' is not in the suite" in done.output, done.output


def test_a_silent_device_is_refused_naming_it(served, tmp_path: Path):
    done = evaluate(served, f"unix://{tmp_path}/nobody.sock", "--scenario", "nominal")
    assert done.exit_code == 2 and "nobody.sock" in done.output and "Traceback" not in done.output, done.output


def test_a_device_serving_another_bundle_of_the_same_name_and_version_is_refused(served, tmp_path):
    """Balancer v1 again, but another graph: the device's statistics carry its graph's sha256, so the evaluation
    host tells the two apart instead of pairing one policy's in-process returns with another's HIL returns."""
    cartpole_store(tmp_path, k=LATENCY_FRAGILE)
    done = evaluate((tmp_path / "b.tar", tmp_path / "k.pub", None, served[3]), served[2], "--scenario", "nominal")
    assert done.exit_code == 2 and "Traceback" not in done.output, done.output
    assert f"{served[2]} serves balancer v1 (graph " in done.output, done.output
    assert "not the bundle under evaluation (graph " in done.output, done.output
