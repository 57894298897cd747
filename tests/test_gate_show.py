"""The gate as people read it: one verdict line in the run summary (failing clauses only), and every clause
behind `sim2edge gate show` from a run's artifacts."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.gate import log_gate, verdict
from stages.twin.gate import GateConfig, floor_checks, suite_checks

SCENARIOS = ("nominal", "mass+20%", "mass-20%", "damping+30%", "damping-30%", "friction+50%", "pushes", "latency+1")


def gate(damping_low: float = 0.95, latency_ms: float = 2.0, nominal_low: float = 0.95) -> list:
    """Twelve clauses as the evaluation makes them: a success floor per scenario (damping+30% held to 0.6), then
    the four suite checks at a 20 ms control period."""
    checks = []
    for name in SCENARIOS:
        low = {"damping+30%": damping_low, "nominal": nominal_low}.get(name, 0.95)
        checks += floor_checks(name, low, 0.6 if name == "damping+30%" else 0.8, 200.0, None)
    return checks + suite_checks(GateConfig(), 0, 0.0, 0.2, latency_ms, 0.02, None)


def test_verdict_of_a_passing_gate():
    assert verdict(gate()) == "pass 12/12"


def test_verdict_lists_only_the_failing_clauses_on_one_line():
    line = verdict(gate(damping_low=0.41, latency_ms=31.0))
    assert line == "FAIL 2/12: damping+30% success rate 0.410 < 0.6; in-loop latency p99 31.000 ms >= 20.0 ms"
    assert len(line) <= 100 and not any(s in line for s in SCENARIOS if s != "damping+30%")


def test_verdict_that_does_not_fit_counts_the_rest():
    line = verdict(gate(damping_low=0.41, latency_ms=31.0, nominal_low=0.5), width=60)
    assert line == "FAIL 3/12: nominal success rate 0.500 < 0.8; +2 more" and len(line) <= 60


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, MlflowClient, str]:
    """A real MLflow store (SQLite) with one experiment: (tracking URI, client, experiment id)."""
    root = tmp_path_factory.mktemp("gate-store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client, client.create_experiment("sim2edge/cartpole", artifact_location=str(root / "artifacts"))


def show(uri: str, ref: str) -> tuple[int, str]:
    """``sim2edge gate show REF`` in this process (MLflow's SQLite store is opened once): exit code, output."""
    done = CliRunner().invoke(app, ["gate", "show", ref], env={"MLFLOW_TRACKING_URI": uri, "COLUMNS": "200"})
    return done.exit_code, done.output


def row(lines: list[str], *cells: str) -> str:
    (found,) = [line for line in lines if all(f" {c} " in line for c in cells)]
    return found


def test_gate_show_prints_every_clause_of_a_pipeline_run_and_a_registered_version(store):
    uri, client, experiment = store
    run = client.create_run(experiment, run_name="pipeline").info.run_id
    checks = gate(damping_low=0.41, latency_ms=31.0)
    log_gate(client, run, checks)  # as chain.log_results logs it on the pipeline's parent run
    client.create_registered_model("cartpole")
    version = client.create_model_version("cartpole", f"{client.get_run(run).info.artifact_uri}/policy", run_id=run,
                                          tags={"sim2edge.pipeline_run_id": run}).version
    client.set_registered_model_alias("cartpole", "challenger", version)
    for ref in (run, "cartpole@challenger"):
        code, out = show(uri, ref)
        lines = out.splitlines()
        assert code == 1, out  # the gate failed
        assert f"gate of run {run}: FAIL (10/12 pass)" in out
        assert "FAIL" in row(lines, "damping+30%", "success rate lower 95% bound", "0.410", ">= 0.6")
        assert "FAIL" in row(lines, "suite", "in-loop latency p99", "31.000 ms", "< 20.0 ms")
        assert "pass" in row(lines, "nominal", "success rate lower 95% bound", "0.950", ">= 0.8")
        assert "pass" in row(lines, "suite", "NaN/Inf actions", "0", "<= 0")
        assert sum(line.startswith(("│ pass ", "│ FAIL ")) for line in lines) == 12


def test_gate_show_reads_an_evaluate_runs_report(store):
    uri, client, experiment = store
    run = client.create_run(experiment, run_name="evaluate").info.run_id
    report = {"passed": True, "checks": [c.model_dump() for c in gate()]}  # the `checks` of evaluation/report.json
    client.log_dict(run, report, "evaluation/report.json")
    code, out = show(uri, run)
    assert code == 0 and f"gate of run {run}: pass (12/12 pass)" in out
    assert "pass" in row(out.splitlines(), "latency+1", "success rate lower 95% bound", "0.950", ">= 0.8")


@pytest.mark.parametrize("ref, message", [("cartpole@nope", "cartpole@nope: no such registered version"),
                                          ("0123456789abcdef", "run 0123456789abcdef: ")])
def test_gate_show_refuses_an_unknown_reference_in_one_line(store, ref, message):
    uri, client, _ = store
    if "@" in ref and not client.search_registered_models("name = 'cartpole'"):
        client.create_registered_model("cartpole")
    code, out = show(uri, ref)
    (line,) = out.strip().splitlines()
    assert code == 2 and line.startswith(f"error: {message}"), line


def test_gate_show_refuses_a_run_without_a_gate(store):
    uri, client, experiment = store
    run = client.create_run(experiment).info.run_id
    assert show(uri, run) == (2, f"error: run {run} has no gate: neither gate.json nor evaluation/report.json\n")
