"""The scenario suite on the shipped ONNX: disturbances act, broken policies are rejected, the report renders."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from stages import standin
from stages.artifacts import ExportedPolicy, TwinSpec
from stages.sim.disturbance import Disturbance
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.twin.evaluate import EvalConfig, evaluate
from stages.twin.gate import GateConfig
from stages.twin.suite import load_suite
from tests.bundles import linear_onnx

BALANCER = (1.0, 0.0, 10.0, 1.0, 1.5)
"""A linear state-feedback cartpole controller (action = K · obs) that balances in every scenario."""

LATENCY_FRAGILE = (1.0, 0.0, 20.0, 1.0, 0.4)
"""Stiff on the pole angle, barely damped: it balances with no delay, and one control step of latency
(20 ms) costs the phase margin it lacks, so the pole oscillates ever wider and falls."""


def linear_policy(tmp_path: Path, k, name: str) -> ExportedPolicy:
    """An exported policy whose graph is ``clip(obs @ K, -1, 1)``: a real ONNX file run by ONNX Runtime."""
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(linear_onnx(np.asarray(k, np.float32).reshape(5, 1)))
    return ExportedPolicy(path=path, digest=name * 4, task="cartpole", opset=17, parity_max_abs_error=0.0, golden=path)


def twin(params: PhysicalParams = PhysicalParams(), truth: PhysicalParams | None = None) -> TwinSpec:
    return TwinSpec(path=Path("twin.json"), digest="twin" * 4, task="cartpole", params=params,
                    dataset_digest="d", standin_truth=truth, replay_error_before=1.0, replay_error_after=1.0)


def test_suite_file_errors_name_the_file_and_field(tmp_path):
    bad = tmp_path / "suite.yaml"
    bad.write_text("scenarios:\n  - name: nominal\n  - name: windy\n    disturbance: {gust: 3}\n")
    with pytest.raises(ValueError, match=r"suite.yaml: scenarios.1.disturbance.gust: Extra inputs"):
        load_suite(bad)
    bad.write_text("scenarios:\n  - name: pushes\n")
    with pytest.raises(ValueError, match="first scenario must be 'nominal'"):
        load_suite(bad)
    assert [s.name for s in load_suite(Path("stages/twin/suites/default.yaml")).scenarios][0] == "nominal"


def test_disturbances_act_on_the_episode():
    task = load("cartpole")
    plain = BatchedEnv(task, 8, seed=3)
    biased = BatchedEnv(task, 8, seed=3, disturbance=Disturbance(obs_bias=0.05))
    offset = biased.observe() - plain.observe()
    assert np.allclose(offset, biased.obs_bias) and 0 < np.abs(offset).max() <= 0.05
    spread = BatchedEnv(task, 8, seed=3, disturbance=Disturbance(init_spread=2.0))
    assert np.allclose(spread.qpos, 2 * plain.qpos) and np.allclose(spread.qvel, 2 * plain.qvel)
    pushed = BatchedEnv(task, 8, seed=3, disturbance=Disturbance(push=0.5, push_every=5, push_steps=2))
    zero = np.zeros((8, 1), np.float32)
    for _ in range(10):
        a, b = plain.step(zero), pushed.step(zero)
    assert np.abs(a.qpos - b.qpos).max() > 1e-3  # the pushes moved the cart


def test_a_balancing_policy_passes_the_suite_and_broken_ones_are_rejected(tmp_path):
    gate = GateConfig()
    good = evaluate(EvalConfig(episodes=16, video=False), gate, linear_policy(tmp_path, BALANCER, "good"), twin(),
                    tmp_path / "good")
    assert good.passed, good.reasons
    assert [s.name for s in good.scenarios][:2] == ["nominal", "damping+30%"] and good.latency_ms_p99 < 20
    for seed in (1, 2, 3):  # every time, on any seeds
        rng = np.random.default_rng(seed)
        broken = {"random-weights": rng.normal(0, 3, 5), "sign-flipped": -np.asarray(BALANCER)}
        for name, k in broken.items():
            r = evaluate(EvalConfig(episodes=16, seed=seed, video=False), gate, linear_policy(tmp_path, k, name), twin(),
                         tmp_path / f"{name}{seed}")
            assert not r.passed and any(x.startswith("FAIL: nominal: success rate") for x in r.reasons), (name, seed)
        r = evaluate(EvalConfig(episodes=16, seed=seed, video=False), gate,
                     linear_policy(tmp_path, LATENCY_FRAGILE, "latency-fragile"), twin(), tmp_path / f"fragile{seed}")
        by_name = {s.name: s for s in r.scenarios}
        assert by_name["nominal"].success_rate == 1.0 and by_name["damping+30%"].success_rate == 1.0  # fine without delay
        assert not r.passed and [x for x in r.reasons if x.startswith("FAIL")] == [
            "FAIL: latency+1: success rate lower 95% bound 0.000 >= 0.5"], seed


def test_sim_to_real_puts_the_calibrated_twin_closer_to_the_stand_in(tmp_path):
    truth = standin.hidden_params("cartpole")
    calibrated = truth.model_copy(update={"damping": truth.damping * 1.03, "actuator_gain": truth.actuator_gain * 0.98})
    r = evaluate(EvalConfig(episodes=16, video=False), GateConfig(), linear_policy(tmp_path, BALANCER, "p"),
                 twin(calibrated, truth), tmp_path / "e")
    assert r.sim_to_real_gap["twin"] < 0.5 * r.sim_to_real_gap["uncalibrated"]


@pytest.mark.ui
def test_report_renders_with_plots_and_videos_in_headless_chromium(tmp_path):
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("chromium is not installed (`apt-get install chromium`; make test does it as root)")
    from playwright.sync_api import sync_playwright

    champion = linear_policy(tmp_path, (0.5, 0.0, 8.0, 0.8, 1.0), "champion")
    from stages.twin.evaluate import Champion

    r = evaluate(EvalConfig(episodes=8), GateConfig(), linear_policy(tmp_path, BALANCER, "p"),
                 twin(PhysicalParams(), standin.hidden_params("cartpole")), tmp_path / "e",
                 Champion(version="3", onnx=champion.path))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(r.html.resolve().as_uri())
        assert page.locator("#verdict").inner_text() in ("PASSED", "FAILED")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.alt, e.complete && e.naturalWidth > 0])")
        browser.close()
    assert dict(images) == {"per-scenario success and return": True, "nominal episode": True, "worst episode": True}
    assert "champion v3" in r.html.read_text() and "stand-in" in r.html.read_text()
