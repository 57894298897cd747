"""End to end: the flow under Prefect's harness, a real MLflow server, the agent pulling the result."""

from __future__ import annotations

import json
from pathlib import Path
import os

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from edge.policy import Policy
from edge.runtime import OnnxRuntime
from edge.store import DeviceStore
from flows.params import PublishSettings, SimToEdgeParams
from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.twin.episodes import run_episodes
from tests.bundles import make_keys
from tests.conftest import run_cli

STAGES = {"collect", "calibrate", "train", "export", "evaluate", "package", "register"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The TUF repository the pipeline publishes its champion to."""
    return tmp_path_factory.mktemp("tuf") / "repo"


@pytest.fixture(scope="module")
def pipeline(mlflow_server, prefect_harness, repo):
    from flows.sim_to_edge import sim_to_edge

    return sim_to_edge(SimToEdgeParams(iterations=100, eval_episodes=32, publish=PublishSettings(repo=str(repo))))


@pytest.fixture(scope="module")
def client(mlflow_server):
    return MlflowClient(mlflow_server)


def agent_pull(ref, url, root, trust, *extra):
    return run_cli("sim2edge-agent", "pull", ref, "--registry", url, "--root", str(root), "--trust", str(trust), *extra)


def test_flow_registers_a_champion_with_lineage(pipeline, client, repo, tmp_path):
    assert pipeline.alias == "champion" and pipeline.success_rate >= 0.8
    mv = client.get_model_version_by_alias("cartpole", "champion")
    assert mv.version == pipeline.version
    assert mv.tags["sim2edge.bundle.sha256"] == pipeline.bundle_sha256
    assert mv.tags["sim2edge.gate"] == "pass" and mv.tags["sim2edge.target"] == "orin-jp6.1"
    parent = client.get_run(pipeline.mlflow_run_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{pipeline.mlflow_run_id}'")
    assert {r.info.run_name for r in children} == STAGES | {"publish"}  # a new champion goes to the repository
    assert all(r.info.status == "FINISHED" for r in children)
    train_run = next(r for r in children if r.info.run_name == "train")
    history = client.get_metric_history(train_run.info.run_id, "mean_return")
    assert len(history) == 100
    logged = Path(client.download_artifacts(pipeline.mlflow_run_id, "run_config.yaml", str(tmp_path)))
    assert SimToEdgeParams.model_validate(yaml.safe_load(logged.read_text())) == SimToEdgeParams(
        iterations=100, eval_episodes=32, publish=PublishSettings(repo=str(repo)))
    targets = json.loads((repo / "metadata" / "targets.json").read_text())["signed"]["targets"]
    published = targets[f"cartpole/{pipeline.version}.tar"]
    assert published["hashes"]["sha256"] == pipeline.bundle_sha256 == targets["cartpole/latest.tar"]["hashes"]["sha256"]
    tag = json.loads(mv.tags["sim2edge.tuf"])
    assert tag["repo"] == str(repo.resolve()) and tag["target_path"] == f"cartpole/{pipeline.version}.tar"


def test_agent_pulls_verifies_and_runs_the_policy(pipeline, mlflow_server, workspace, tmp_path):
    root = tmp_path / "device"
    trust = workspace.keys_dir / "signing.pub"
    done = agent_pull("cartpole@champion", mlflow_server, root, trust, "--skip-target-check")
    assert done.returncode == 0, done.stderr
    assert f"activated cartpole v{pipeline.version}" in done.stdout
    status = run_cli("sim2edge-agent", "status", "--root", str(root), "--json")
    info = json.loads(status.stdout)
    assert info["version"] == pipeline.version and info["source"] == mlflow_server
    assert info["run_id"] == pipeline.mlflow_run_id
    # the installed artifact is what runs: drive the twin with it
    current = DeviceStore(root).link("current")
    task = load("cartpole")
    result = run_episodes(OnnxRuntime(current / "policy.onnx"), BatchedEnv(task, 8, seed=77))
    assert result.success.mean() >= 0.75
    policy = Policy.load(root)
    policy.check_names([o.name for o in task.observations])
    obs = BatchedEnv(task, 4, seed=5).observe()
    np.testing.assert_allclose(policy.act(obs), OnnxRuntime(current / "policy.onnx").run(obs), atol=1e-6)
    again = agent_pull(f"cartpole@{pipeline.version}", mlflow_server, root, trust, "--skip-target-check")
    assert again.returncode == 0 and "already active" in again.stdout


def snapshot(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "tmp" not in p.parts), \
        os.readlink(root / "current") if (root / "current").is_symlink() else None


def test_refusals_leave_the_store_untouched(pipeline, mlflow_server, workspace, tmp_path):
    root = tmp_path / "device"
    trust = workspace.keys_dir / "signing.pub"
    assert agent_pull("cartpole@champion", mlflow_server, root, trust, "--skip-target-check").returncode == 0
    before = snapshot(root)
    for args, message, code in [(("cartpole@nope", mlflow_server, root, trust), "nope not found", 2),  # an error
                                (("cartpole@champion", "http://127.0.0.1:9", root, trust), "unreachable", 3)]:
        r = agent_pull(*args)
        assert r.returncode == code and message in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1, "one-line error"
        assert snapshot(root) == before


def test_wrong_key_installs_nothing(pipeline, mlflow_server, tmp_path):
    _, wrong = make_keys(tmp_path, "wrong")
    root = tmp_path / "fresh"
    r = agent_pull("cartpole@champion", mlflow_server, root, wrong, "--skip-target-check")
    assert r.returncode == 1 and "signature: manifest signature does not match" in r.stderr
    assert not (root / "current").exists() and not (root / "bundles").exists()
    assert json.loads((root / "journal.jsonl").read_text().splitlines()[-1])["check"] == "signature"


def test_target_mismatch_is_refused(pipeline, mlflow_server, workspace, tmp_path):
    r = run_cli("sim2edge-agent", "pull", "cartpole@champion", "--registry", mlflow_server, "--root",
                str(tmp_path / "d"), "--trust", str(workspace.keys_dir / "signing.pub"), env={"L4T_VERSION": "35.4.1"})
    assert r.returncode == 1 and "target: bundle is for orin-jp6.1" in r.stderr
    assert not (tmp_path / "d" / "current").exists()


def test_failing_gate_registers_a_challenger_and_keeps_the_champion(pipeline, client, repo):
    from flows.sim_to_edge import sim_to_edge

    weak = sim_to_edge(SimToEdgeParams(iterations=1, eval_episodes=8, publish=PublishSettings(repo=str(repo))))
    assert weak.alias == "challenger"
    targets = json.loads((repo / "metadata" / "targets.json").read_text())["signed"]["targets"]
    assert f"cartpole/{weak.version}.tar" not in targets  # only a champion goes to the fleet
    reason, command = weak.pull_command.splitlines()  # the printed pull says why, and adds the flag
    failed = [r for r in weak.gate_reasons if r.startswith("FAIL")]
    assert "failed its evaluation gate" in reason and failed and all(r in reason for r in failed), reason
    assert command.endswith("--allow-failed-gate")
    assert client.get_model_version_by_alias("cartpole", "champion").version == pipeline.version
    assert client.get_model_version_by_alias("cartpole", "challenger").version == weak.version
    assert client.get_model_version("cartpole", weak.version).tags["sim2edge.gate"] == "fail"


def test_stage_failure_moves_no_alias_and_leaves_no_version(pipeline, client, monkeypatch):
    import flows.sim_to_edge as flow_module
    import flows.stage_tasks as stage_tasks

    versions = {v.version for v in client.search_model_versions("name='cartpole'")}

    def broken(*args, **kwargs):
        raise RuntimeError("injected packaging failure")

    monkeypatch.setattr(stage_tasks, "package", broken)
    with pytest.raises(RuntimeError, match="injected packaging failure"):
        flow_module.sim_to_edge(SimToEdgeParams(iterations=1, eval_episodes=4))
    assert {v.version for v in client.search_model_versions("name='cartpole'")} == versions
    assert client.get_model_version_by_alias("cartpole", "champion").version == pipeline.version
    failed = client.search_runs([client.get_experiment_by_name("sim2edge/cartpole").experiment_id],
                                filter_string="attributes.status = 'FAILED'")
    assert {r.info.run_name for r in failed} >= {"package"}


def test_newer_version_then_refused_downgrade_then_rollback(pipeline, client, mlflow_server, workspace, tmp_path):
    root, trust = tmp_path / "device", workspace.keys_dir / "signing.pub"
    newer = client.get_model_version_by_alias("cartpole", "challenger").version  # from the failing-gate test
    assert int(newer) > int(pipeline.version)
    assert agent_pull(f"cartpole@{pipeline.version}", mlflow_server, root, trust, "--skip-target-check").returncode == 0
    refused = agent_pull("cartpole@challenger", mlflow_server, root, trust, "--skip-target-check")
    assert refused.returncode == 1 and "gate:" in refused.stderr and "--allow-failed-gate" in refused.stderr
    assert agent_pull("cartpole@challenger", mlflow_server, root, trust, "--skip-target-check",
                      "--allow-failed-gate").returncode == 0
    store = DeviceStore(root)
    assert store.link("current").name == newer and store.link("previous").name == pipeline.version
    old = agent_pull(f"cartpole@{pipeline.version}", mlflow_server, root, trust, "--skip-target-check")
    assert old.returncode == 1 and "freshness:" in old.stderr
    assert store.link("current").name == newer
    back = run_cli("sim2edge-agent", "rollback", "--root", str(root), "--trust", str(trust))
    assert back.returncode == 0, back.stderr
    assert store.link("current").name == pipeline.version and store.link("previous").name == newer
    assert run_cli("sim2edge-agent", "verify", "--root", str(root), "--trust", str(trust)).returncode == 0
    events = [json.loads(line)["event"] for line in run_cli("sim2edge-agent", "history", "--root", str(root)).stdout.splitlines()]
    assert events == ["activate", "refused", "activate", "refused", "rollback"]  # gate refusal, then freshness
    gc = run_cli("sim2edge-agent", "gc", "--root", str(root), "--keep", "0")
    assert gc.returncode == 0 and "removed: nothing" in gc.stdout  # both are pinned as current/previous


def test_evaluate_command_on_a_registered_version_and_on_a_bundle(pipeline, client, workspace, tmp_path):
    r = run_cli("sim2edge", "evaluate", f"cartpole@{pipeline.version}", "--episodes", "8", "--no-video")
    assert r.returncode == (0 if "PASSED;" in r.stdout else 1), r.stderr  # the exit status is the gate's verdict
    assert f"cartpole v{pipeline.version}" in r.stdout and "pushes" in r.stdout and "report" in r.stdout
    run = client.search_runs([client.get_experiment_by_name("sim2edge/cartpole").experiment_id],
                             f"tags.`sim2edge.evaluated` = 'cartpole v{pipeline.version}'")[0]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")} >= {"evaluation/report.html",
                                                                                       "evaluation/report.json"}
    mv = client.get_model_version("cartpole", pipeline.version)
    tar = Path(client.download_artifacts(mv.run_id, "bundle/bundle.tar", str(tmp_path)))
    few = run_cli("sim2edge", "evaluate", "--bundle", str(tar), "--episodes", "4", "--no-video")
    assert "nominal model" in few.stdout, few.stderr
    # 4 of 4 successes: the Wilson lower bound (0.51) is below the 0.8 floor, so the gate fails and says why
    assert few.returncode == 1 and "FAILED;" in few.stdout and "nominal: success rate lower 95% bound" in few.stdout
    tampered = tmp_path / "tampered.tar"
    data = bytearray(tar.read_bytes())
    data[len(data) // 2] ^= 1
    tampered.write_bytes(bytes(data))
    bad = run_cli("sim2edge", "evaluate", "--bundle", str(tampered), "--episodes", "4")
    assert bad.returncode == 2 and "tampered.tar" in bad.stdout
