"""What stock MLflow (its client, pyfunc and onnx flavors, the UI's tags) sees of what sim2edge logs.

The fast tests drive ``registry`` against the session's real tracking server; the slow one runs the
pipeline, a stock client and the agent in mount namespaces where the server's artifact folder is an
empty tmpfs, as on a host that does not share the server's disk.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import mlflow
import mlflow.onnx
import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow.entities import LoggedModelStatus
from mlflow.tracking import MlflowClient

from edge import bundle, signing
from edge.runtime import OnnxRuntime
from flows.chain import summary_markdown
from flows.stage_tasks import metric_name
from flows.params import PipelineSummary
from registry import models, policy_model
from registry.tracking import EXPERIMENT_KIND, ensure_experiment
from stages.sim.registry import load
from tests.bundles import TINY_IO, linear_onnx, make_bundle, make_keys
from tests.test_e2e import STAGES

TERMS = [t["name"] for t in TINY_IO["input"]["terms"]]


@pytest.fixture(scope="module")
def client(mlflow_server):
    return MlflowClient(mlflow_server)


def register_tiny(client: MlflowClient, tmp: Path, name: str, weights: np.ndarray, artifact_root: Path | None) -> Path:
    """The package stage's registry calls on a small real policy: logged model → version → bundle → upload → alias."""
    onnx_path, golden = tmp / "policy.onnx", tmp / "golden.npz"
    onnx_path.write_bytes(linear_onnx(weights))
    x = np.random.default_rng(0).normal(size=(8, weights.shape[0])).astype(np.float32)
    np.savez(golden, inputs=x, outputs=OnnxRuntime(onnx_path).run(x))
    experiment = ensure_experiment(client, "conformance", artifact_root)
    run = client.create_run(experiment).info.run_id
    model = policy_model.create(client, experiment, run, name, {"sim2edge.target": "orin-jp6.1"})
    version = models.reserve_version(client, name, run, policy_model.version_source(client, model), {},
                                     model_id=model.model_id)
    priv, pub = make_keys(tmp)
    tar = tmp / "bundle.tar"
    make_bundle(tar, priv, files={"policy.onnx": onnx_path.read_bytes(), "golden.npz": golden.read_bytes()},
                io=TINY_IO, version=version, name=name)
    bundle.extract(tar, tmp / "unpacked", 1 << 24)
    manifest = bundle.verify_dir(tmp / "unpacked", signing.load_trusted([pub]))
    policy_model.upload(client, model, onnx_path, golden, tar, manifest)
    client.log_artifact(run, str(tar), "bundle")
    path = models.proxy_path(client.get_run(run).info.artifact_uri + "/bundle/bundle.tar", artifact_root)
    assert models.publish(client, name, version, path, bundle.sha256_path(tar), tar.stat().st_size, True, {}, None) \
        == "champion"
    client.set_terminated(run)
    return onnx_path


@pytest.mark.parametrize("store", ["server", "embedded"])
def test_the_champion_loads_with_stock_mlflow_and_acts_as_the_device_runtime(store, mlflow_server, tmp_path, monkeypatch):
    # embedded: a SQLite store with file:// artifacts while the process-global tracking URI names another store
    uri = mlflow_server if store == "server" else f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, root = MlflowClient(uri), (None if store == "server" else tmp_path / "artifacts")
    weights = np.linspace(-0.4, 0.4, 5, dtype=np.float32).reshape(5, 1)
    onnx_path = register_tiny(client, tmp_path, "conformance-tiny", weights, root)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where the stock calls below look
    model_uri = "models:/conformance-tiny@champion"
    obs = np.random.default_rng(3).normal(size=(16, 5)).astype(np.float32)
    expected = OnnxRuntime(onnx_path).run(obs)

    pyfunc = mlflow.pyfunc.load_model(model_uri)
    shuffled = pd.DataFrame(obs, columns=TERMS)[TERMS[::-1]]  # the model's loader puts named columns in order
    got = pyfunc.predict(shuffled)["action"].to_numpy().reshape(len(obs), -1)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"policy input: missing terms \['e'\]"):
        pyfunc.predict(pd.DataFrame(obs[:, :4], columns=TERMS[:4]))  # a missing term is refused, not misread

    graph = mlflow.onnx.load_model(model_uri)
    assert [i.name for i in graph.graph.input] == ["obs"]

    info = mlflow.models.get_model_info(model_uri)
    assert info.signature.inputs is None  # else MLflow's enforcement would refuse arrays before the loader sees them
    assert info.signature.outputs.inputs[0].shape == (-1, 1)
    assert [t["name"] for t in info.metadata["sim2edge.observations"]] == TERMS
    assert info.flavors["python_function"]["loader_module"] == "sim2edge_pyfunc"
    assert [a["name"] for a in info.metadata["sim2edge.actions"]] == ["u"]
    assert info.metadata["sim2edge.actions"][0]["low"] == -0.5
    experiment = client.get_experiment_by_name("conformance").experiment_id
    logged = mlflow.search_logged_models(experiment_ids=[experiment], output_format="list")
    assert [m.model_id for m in logged if m.name == "conformance-tiny"] == [info.model_id]
    assert logged[0].status == LoggedModelStatus.READY
    assert logged[0].artifact_location.startswith("mlflow-artifacts:/" if store == "server" else "file:///")
    mv = client.get_model_version_by_alias("conformance-tiny", "champion")
    assert mv.source == (f"models:/{info.model_id}" if store == "server" else logged[0].artifact_location)
    assert mv.tags["sim2edge.bundle.path"].startswith(f"{experiment}/" if store == "server" else "conformance/")
    if store == "server":  # what the UI's version page reads for its Schema table and metadata
        query = urllib.parse.urlencode({"path": "MLmodel", "name": mv.name, "version": mv.version})
        with urllib.request.urlopen(f"{mlflow_server}/model-versions/get-artifact?{query}", timeout=30) as r:
            mlmodel = yaml.safe_load(r.read())
        assert [t["name"] for t in mlmodel["metadata"]["sim2edge.observations"]] == TERMS
        assert json.loads(mlmodel["signature"]["outputs"])[0]["tensor-spec"]["shape"] == [-1, 1]

    files = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "download")))
    assert {"MLmodel", "model.onnx", "input_example.json", "extra_files", "code"} <= {p.name for p in files.iterdir()}
    assert (files / "extra_files" / "bundle.tar").read_bytes() == (tmp_path / "bundle.tar").read_bytes()
    example = json.loads((files / "input_example.json").read_text())
    assert example["columns"] == TERMS


def test_experiments_through_a_server_use_its_artifact_proxy_and_open_as_model_training(client, tmp_path):
    # `sim2edge up` passes the workspace's artifact folder; through a server it must not become a file:// location
    eid = ensure_experiment(client, "conformance/proxy", tmp_path / "artifacts")
    exp = client.get_experiment(eid)
    assert exp.artifact_location.startswith("mlflow-artifacts:/"), exp.artifact_location
    assert exp.tags["mlflow.experimentKind"] == EXPERIMENT_KIND["mlflow.experimentKind"] == "custom_model_development"
    run = client.create_run(eid).info
    assert run.artifact_uri.startswith("mlflow-artifacts:/")
    # an experiment created before the kind existed gets it on its next use
    old = client.create_experiment("conformance/old")
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    assert ensure_experiment(client, "conformance/old", None) == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_experiment_another_run_creates_between_the_read_and_the_create_is_used(client, tmp_path):
    """Two runs of a new policy at once (tests/test_team_runs.py, PostgreSQL): both read no experiment, one creates
    it, the other's create answers RESOURCE_ALREADY_EXISTS and must use the one that now exists. Here the other run
    is this test creating it right after ensure_experiment's first read, on the real server."""
    other = MlflowClient(client.tracking_uri)

    class Late(MlflowClient):
        reads = 0

        def get_experiment_by_name(self, name):
            Late.reads += 1
            if Late.reads == 1:  # read: none yet; then the other run creates it
                other.create_experiment(name, tags=EXPERIMENT_KIND)
                return None
            return super().get_experiment_by_name(name)

    eid = ensure_experiment(Late(client.tracking_uri), "conformance/race", tmp_path / "artifacts")
    assert eid == client.get_experiment_by_name("conformance/race").experiment_id and Late.reads == 2


def test_an_unreachable_file_experiment_behind_a_server_is_refused_in_one_line(client, tmp_path):
    client.create_experiment("conformance/legacy", artifact_location=(tmp_path / "gone").as_uri())
    with pytest.raises(ValueError) as e:
        ensure_experiment(client, "conformance/legacy", None)
    message = str(e.value)
    assert "\n" not in message and "conformance/legacy" in message and "cannot reach" in message
    assert "artifact proxy" in message and (tmp_path / "gone").as_uri() in message
    (tmp_path / "gone").mkdir()  # on this host (an embedded run before `sim2edge up`): still usable
    assert ensure_experiment(client, "conformance/legacy", None)


def test_the_prefect_summary_writes_the_gate_as_words():
    summary = PipelineSummary(policy="cartpole", version="3", alias="challenger", success_rate=0.5, mean_return=1.0,
                              gate_reasons=("pass: nominal: fine", "fail: pushes: success rate too low"),
                              bundle_sha256="0" * 64, mlflow_run_id="r", tracking_uri="sqlite:///x", pull_command="p",
                              stage_seconds={"train": 1.0})
    text = summary_markdown(summary)
    assert "| nominal: fine | pass |" in text and "| pushes: success rate too low | FAIL |" in text
    assert "✅" not in text and "❌" not in text


WORKER = """
import sys
from flows.params import SimToEdgeParams
from flows.sim_to_edge import sim_to_edge
from stages.twin.gate import GateConfig

summary = sim_to_edge(SimToEdgeParams(iterations=2, num_envs=16, eval_episodes=4, model_prefix=sys.argv[1],
                                      gate=GateConfig(min_success_rate=0.5)))
print("SUMMARY " + summary.model_dump_json())
"""

STOCK_CLIENT = """
import json, sys
from pathlib import Path
import mlflow, numpy as np, pandas as pd
from mlflow.tracking import MlflowClient

ref, run_id, dst = sys.argv[1], sys.argv[2], Path(sys.argv[3])
uri = f"models:/{ref}"
files = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(dst / "model")))
tar = MlflowClient().download_artifacts(run_id, "bundle/bundle.tar", str(dst / "run"))
columns = [t["name"] for t in mlflow.models.get_model_info(uri).metadata["sim2edge.observations"]]
obs = np.random.default_rng(0).normal(size=(8, len(columns))).astype(np.float32)
actions = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame(obs, columns=columns))["action"].to_numpy()
print("RESULT " + json.dumps({"files": sorted(p.name for p in files.iterdir()), "bundle_bytes": Path(tar).stat().st_size,
                               "columns": columns, "obs": obs.tolist(), "actions": actions.reshape(len(obs), -1).tolist()}))
"""


def hidden(folder: Path, *cmd: str, env: dict) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new mount namespace where ``folder`` is an empty tmpfs (a host without the server's disk)."""
    script = 'mount -t tmpfs tmpfs "$0" && test -z "$(ls -A "$0")" && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, str(folder), *cmd], capture_output=True, text=True,
                          env=env, timeout=600)


def tagged_line(out: str, tag: str) -> dict:
    return json.loads(next(line for line in out.splitlines() if line.startswith(tag + " "))[len(tag) + 1:])


@pytest.mark.slow
def test_a_pipeline_and_clients_on_hosts_without_the_servers_disk(mlflow_server, prefect_harness, workspace, client,
                                                                   tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs `unshare -m` (root or CAP_SYS_ADMIN) to hide the server's artifact folder")
    from prefect.settings import PREFECT_API_URL

    disk = workspace.mlflow_artifacts  # the server's --artifacts-destination
    worker = tmp_path / "worker"
    env = dict(os.environ, SIM2EDGE_HOME=str(worker), PREFECT_LOCAL_STORAGE_PATH=str(worker / "prefect" / "storage"),
               MLFLOW_TRACKING_URI=mlflow_server, PREFECT_API_URL=PREFECT_API_URL.value())
    done = hidden(disk, sys.executable, "-c", WORKER, "xhost-", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = PipelineSummary.model_validate(tagged_line(done.stdout, "SUMMARY"))
    name = "xhost-cartpole"
    ref = f"{name}@{summary.alias}"  # two iterations: the gate decides which alias, any serves here
    assert summary.policy == name

    # everything was logged through the artifact proxy, onto the server's disk
    experiment = client.get_experiment_by_name(f"sim2edge/{name}")
    assert experiment.artifact_location.startswith("mlflow-artifacts:/")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    stage_runs = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == summary.mlflow_run_id}
    assert stage_runs == STAGES and all(r.info.artifact_uri.startswith("mlflow-artifacts:/") for r in runs)
    mv = client.get_model_version(name, summary.version)
    assert mv.source.startswith("models:/m-") and (disk / mv.tags["sim2edge.bundle.path"]).is_file()
    logged = list(client.search_logged_models([experiment.experiment_id]))
    assert [m.model_id for m in logged] == [mv.source.removeprefix("models:/")]
    assert logged[0].artifact_location.startswith("mlflow-artifacts:/") and logged[0].source_run_id == mv.run_id

    # the parent run compares pipelines: their parameters and headline results
    parent = client.get_run(summary.mlflow_run_id).data
    assert parent.params["model_prefix"] == "xhost-" and parent.params["iterations"] == "2"
    assert parent.params["gate.min_success_rate"] == "0.5" and parent.params["task"] == "cartpole"
    passed = mv.tags["sim2edge.gate"] == "pass"
    assert parent.metrics["gate_passed"] == float(passed) and parent.metrics["promoted"] == float(passed)
    assert parent.metrics["success_rate"] == pytest.approx(summary.success_rate)
    for scenario in summary.scenarios:
        key = metric_name(scenario.name)  # the same names as the evaluate stage's run
        assert parent.metrics[f"mean_return.{key}"] == pytest.approx(scenario.mean_return)
        assert parent.metrics[f"success_rate.{key}"] == pytest.approx(scenario.success_rate)
    assert parent.metrics["seconds.train"] == pytest.approx(summary.stage_seconds["train"])
    assert parent.tags["sim2edge.model_version"] == summary.version and parent.tags["sim2edge.alias"] == summary.alias

    # a device pulls it, and a stock client reads it, on hosts that cannot see that disk either
    root = tmp_path / "device"
    agent = Path(sys.executable).parent / "sim2edge-agent"
    pulled = hidden(disk, str(agent), "pull", ref, "--registry", mlflow_server, "--root", str(root),
                    "--trust", str(worker / "keys" / "signing.pub"), "--skip-target-check",
                    *([] if passed else ["--allow-failed-gate"]), env=env)
    assert pulled.returncode == 0 and f"activated {name} v{summary.version}" in pulled.stdout, pulled.stderr
    read = hidden(disk, sys.executable, "-c", STOCK_CLIENT, ref, mv.run_id, str(tmp_path / "laptop"), env=env)
    assert read.returncode == 0, read.stderr[-3000:]
    result = tagged_line(read.stdout, "RESULT")
    assert {"MLmodel", "model.onnx", "extra_files"} <= set(result["files"]) and result["bundle_bytes"] > 0
    assert result["columns"] == [o.name for o in load("cartpole").observations]
    device = OnnxRuntime(root / "current" / "policy.onnx").run(np.array(result["obs"], np.float32))
    np.testing.assert_allclose(np.array(result["actions"]), device, atol=1e-6)
