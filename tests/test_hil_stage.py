"""The pipeline's ``hil_evaluate`` stage: the flow under Prefect's harness with a real MLflow server; the stage serves
the packaged, signed bundle with a real ``sim2edge-agent run`` on loopback (``hil.device: local``).

A tiny pipeline (2 PPO iterations, 2 evaluation episodes): what is checked is the stage's wiring, logging and the
promotion decision, not the policy; HIL episodes are cut to 40 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from edge.errors import CheckFailed
from flows.params import CalibrateSettings, SimToEdgeParams
from flows.run_config import RunConfigError, resolve
from stages.twin.hil import hil_task
from stages.twin.hil_link import DeviceLink
from stages.twin.hil_stage import HilSettings, hil_metrics, run_hil_stage
from stages.twin.report import write_hil
from tests.bundles import make_keys
from tests.test_hil import cartpole_store

TINY = dict(iterations=2, num_envs=16, eval_episodes=2, collect_episodes=2, seed=23, model_prefix="hil-stage-",
            calibrate=CalibrateSettings(max_windows=16, generations=2, search_generations=1, max_latency=1,
                                        joint_steps=0, bootstrap=20))


def hil(gate: Path, floors: str) -> dict:
    gate.write_text(floors)
    return {"device": "local", "gate_file": gate, "episodes": 1, "max_steps": 40}


def answers(address: str) -> bool:
    link = DeviceLink(address)
    try:
        return link.stats(timeout_s=0.3, tries=1) is not None
    except ConnectionRefusedError:
        return False
    finally:
        link.close()


def test_local_bench_device_serves_the_signed_bundle_for_the_stage_only(tmp_path):
    """tests/test_hil.py's signed balancer bundle: the stage installs it, serves it with the agent, stops it."""
    cartpole_store(tmp_path)
    cfg = HilSettings(device="local", episodes=1, max_steps=30)
    report = run_hil_stage(cfg, tmp_path / "b.tar", tmp_path / "k.pub", tmp_path / "policy.onnx", "cartpole",
                           hil_task("cartpole").nominal_params(), 1000, tmp_path / "hil")
    assert report.passed, report.checks
    assert report.device.startswith("udp://127.0.0.1:") and not answers(report.device)  # stopped after the stage
    assert report.device_runtime == "onnxruntime (CPUExecutionProvider)"  # from the agent's own statistics
    assert (tmp_path / "hil" / "device" / "current").exists()  # the bench device's store, as an agent pull leaves it
    m = hil_metrics(report)
    assert m["hil.gate_passed"] == 1.0 and m["hil.nominal.falls"] == 0 and m["hil.nominal.rtt_ms_p99"] < 20
    assert m["hil.nominal.mean_return"] == pytest.approx(m["hil.nominal.in_process_mean_return"], rel=0.05)
    page = write_hil(json.loads(report.to_json()), tmp_path / "hil.html").read_text()
    assert "<span id=verdict>PASSED</span>" in page and "onnxruntime (CPUExecutionProvider)" in page
    assert "<th>return in-process (95%)</th><th>return HIL (95%)</th>" in page and "<td>nominal</td>" in page

    _, other = make_keys(tmp_path, "other")
    with pytest.raises(CheckFailed, match="signature"):  # the bench device trusts only the workspace's key
        run_hil_stage(cfg, tmp_path / "b.tar", other, tmp_path / "policy.onnx", "cartpole",
                      hil_task("cartpole").nominal_params(), 1000, tmp_path / "hil2")


def stage_run(client: MlflowClient, parent_id: str, name: str):
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    return next(r for r in runs if r.info.run_name == name)


@pytest.mark.slow  # two pipeline runs: 60–105 s on 2 cores, after the harness and the MLflow server start (~90 s)
def test_hil_stage_logs_results_and_a_failing_hil_gate_keeps_a_challenger(mlflow_server, prefect_harness, tmp_path):
    from flows.sim_to_edge import sim_to_edge

    client = MlflowClient(mlflow_server)
    # the paired-return floor is out of the way (the policy is barely trained): the link's floors decide
    lenient = sim_to_edge(SimToEdgeParams(**TINY, hil=hil(tmp_path / "ok.yaml", "return_margin: 1000000\n")))
    run = stage_run(client, lenient.mlflow_run_id, "hil_evaluate")
    assert run.info.status == "FINISHED" and run.data.tags["sim2edge.hil_gate"] == "pass"
    assert run.data.tags["sim2edge.hil_runtime"] == "onnxruntime (CPUExecutionProvider)"
    m = run.data.metrics
    assert m["hil.gate_passed"] == 1.0 and m["hil.nominal.deadline_miss_fraction"] <= 0.05
    assert 0 < m["hil.nominal.rtt_ms_p50"] <= m["hil.nominal.rtt_ms_p99"] <= m["hil.nominal.rtt_ms_max"] < 20
    assert {"hil.nominal.success_rate", "hil.nominal.mean_return", "hil.nominal.late_actions",
            "hil.nominal.lost_actions", "hil.nominal.in_process_mean_return"} <= set(m)
    doc = json.loads(Path(client.download_artifacts(run.info.run_id, "hil.json", str(tmp_path))).read_text())
    assert doc["passed"] and doc["device_runtime"] == "onnxruntime (CPUExecutionProvider)"
    assert doc["device"].startswith("udp://127.0.0.1:") and doc["seed"] == TINY["seed"] + 1000
    row = doc["scenarios"][0]
    assert 0 < row["hil"]["steps"] <= 40 and row["device"]["observations"] >= row["hil"]["steps"]  # it may fall
    page = Path(client.download_artifacts(run.info.run_id, "hil.html", str(tmp_path))).read_text()
    assert "<span id=verdict>PASSED</span>" in page and "<th>success HIL</th>" in page
    gate = json.loads(Path(client.download_artifacts(run.info.run_id, "gate.json", str(tmp_path))).read_text())
    assert gate["passed"] and len(gate["checks"]) == 3
    mv = client.get_model_version(lenient.policy, lenient.version)
    assert mv.tags["sim2edge.hil_gate"] == "pass" and "sim2edge.not_promoted" not in mv.tags
    assert len(lenient.hil_checks) == 3 and all(c.passed for c in lenient.hil_checks)
    assert stage_run(client, lenient.mlflow_run_id, "register").info.start_time >= run.info.end_time

    # the same candidate (every cached stage reused), a round-trip budget no link meets
    strict = sim_to_edge(SimToEdgeParams(**TINY, hil=hil(tmp_path / "strict.yaml", "max_round_trip_fraction: 0.001\n")))
    mv = client.get_model_version(strict.policy, strict.version)
    assert strict.alias == "challenger" and mv.tags["sim2edge.hil_gate"] == "fail" and mv.tags["sim2edge.gate"] == "fail"
    assert mv.tags["sim2edge.not_promoted"].startswith("HIL gate failed: HIL round-trip p99 ("), mv.tags
    assert "--allow-failed-gate" in strict.pull_command and "HIL round-trip p99" in strict.pull_command
    run = stage_run(client, strict.mlflow_run_id, "hil_evaluate")
    assert run.data.tags["sim2edge.hil_gate"] == "fail" and run.data.metrics["hil.gate_passed"] == 0.0


@pytest.mark.parametrize("assignment, message", [
    ("hil.device=tcp://127.0.0.1:9", "hil.device: Value error, device address 'tcp://127.0.0.1:9' must be"),
    ("hil.device=udp://127.0.0.1:port", "hil.device: Value error"),
    ("hil={device: local, misses: 3}", "hil.misses: not a key here; allowed: device, gate_file, episodes"),
    ("hil.device=[udp://127.0.0.1:9, udp://127.0.0.1:9]",
     "hil.device: Value error, device udp://127.0.0.1:9 is given twice"),
    ("hil.device=[local]", "hil.device: Value error, device address 'local' must be"),
])
def test_a_bad_hil_setting_is_refused_in_one_line_naming_the_field(assignment, message):
    with pytest.raises(RunConfigError) as e:
        resolve("cartpole", None, [assignment], {})
    assert message in str(e.value) and "\n" not in str(e.value), e.value
