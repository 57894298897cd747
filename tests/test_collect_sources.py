"""Collect from the registry (device telemetry runs) and the standalone collect/calibrate commands."""

from __future__ import annotations

import io
import json
import signal
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from edge import bundle, signing, telemetry
from edge.control import decode_action, encode_observation
from edge.store import DeviceStore
from flows.steps import collect_step
from flows.workspace import Workspace
from registry.telemetry import upload
from registry.tracking import standalone
from stages import logs, standin
from stages.collect.device_logs import convert
from stages.collect.ingest import ingest_folder
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore
from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from tests.bundles import linear_onnx, make_bundle, make_keys
from tests.conftest import run_cli
from tests.test_agent_run import Client as AgentClient, start as start_agent


def _collect_runs(client: MlflowClient, experiment_id: str):
    return client.search_runs([experiment_id], "tags.`sim2edge.stage` = 'collect'", order_by=["attributes.start_time DESC"])


def test_registry_telemetry_ingests_only_what_is_new(mlflow_server, tmp_path):
    client = MlflowClient(mlflow_server)
    ws = Workspace(home=tmp_path / "ws")
    task, hidden = load("cartpole"), standin.hidden_params("cartpole")
    first = record(task, hidden, 2, 11, tmp_path / "robot7-a.parquet", "robot-7", policy_version="3")
    upload(client, [first], "cartpole", "robot-7", "3")
    ctx = standalone(mlflow_server, "sim2edge/cartpole-telemetry-test", None)

    one = collect_step(ctx, ws, "cartpole", "registry")
    assert [p.rsplit("/", 1)[-1] for p in one.added] == ["robot7-a.parquet"] and one.dataset.version == 1
    again = collect_step(ctx, ws, "cartpole", "registry")
    assert again.added == () and not again.new_version and again.dataset == one.dataset

    second = record(task, hidden, 2, 12, tmp_path / "robot7-b.parquet", "robot-7", policy_version="4")
    bad = tmp_path / "robot7-nan.parquet"
    table = pq.read_table(second)
    values = table.column("qvel.0").to_numpy().copy()
    values[3] = np.nan
    logs.write(table.set_column(table.column_names.index("qvel.0"), "qvel.0", pa.array(values)), bad)
    upload(client, [second, bad], "cartpole", "robot-7", "4")
    two = collect_step(ctx, ws, "cartpole", "registry")
    assert [p.rsplit("/", 1)[-1] for p in two.added] == ["robot7-b.parquet"] and two.dataset.version == 2
    (q,) = two.quarantined
    assert "robot7-nan.parquet: episode 0, column 'qvel.0', row 3" in q.reason

    run = _collect_runs(client, ctx.experiment_id)[0]
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "cartpole-v0002" and inp.dataset.digest == two.dataset.digest[:32]
    assert {t.key: t.value for t in inp.tags}["sim2edge.dataset_digest"] == two.dataset.digest
    assert run.data.metrics["quarantined_files"] == 1 and run.data.tags["sim2edge.robots"] == "robot-7"


def test_collect_and_calibrate_commands(tmp_path):
    env = {"SIM2EDGE_HOME": str(tmp_path / "ws"), "COLUMNS": "160"}
    unset = ("MLFLOW_TRACKING_URI",)
    out = run_cli("sim2edge", "collect", "--task", "cartpole", "--episodes", "6", env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "dataset cartpole v0001 (new): 6 episodes, 1500 rows" in out.stdout

    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "cut.parquet").write_bytes(b"PAR1 not really")
    out = run_cli("sim2edge", "collect", "--task", "cartpole", "--source", "folder", "--folder", str(uploads),
                  env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "quarantined" in out.stdout and "cut.parquet" in out.stdout and "unchanged" in out.stdout

    out = run_cli("sim2edge", "calibrate", "--task", "cartpole", "--generations", "12", "--max-latency", "0",
                  env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "stand-in truth" in out.stdout and "replay error" in out.stdout and "noise floor" in out.stdout
    assert "95% interval" in out.stdout and "twin.xml" in out.stdout
    assert (tmp_path / "ws" / "twins" / "cartpole" / "v0001" / "twin.json").exists()

    out = run_cli("sim2edge", "calibrate", "--task", "cartpole", "--dataset", "v0007", env=env, unset=unset)
    assert out.returncode == 2 and "no dataset version 'v0007'" in out.stdout and "versions: v0001" in out.stdout
    out = run_cli("sim2edge", "collect", "--task", "nope", env=env, unset=unset)
    assert out.returncode == 2 and "valid tasks: arm6, cartpole, quadruped, reacher" in out.stdout


# -- the agent's .npz telemetry: closed loop through `sim2edge-agent run`, upload, collect ---------------

def _cartpole_store(tmp_path: Path) -> Path:
    """A device store whose active bundle speaks cart-pole's I/O contract (a linear policy)."""
    task = load("cartpole")
    w = np.array([[0.3], [0.0], [-0.8], [0.2], [-0.4]], np.float32)
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, inputs=x, outputs=np.clip(x @ w, -1, 1))
    contract = {"input": {"terms": [{"name": o.name, "unit": o.unit} for o in task.observations]},
                "output": {"terms": [{"name": a.name, "unit": a.unit} for a in task.actions],
                           "low": [-1.0], "high": [1.0], "default": [0.0]}}
    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv, {"policy.onnx": linear_onnx(w), "golden.npz": buf.getvalue()},
                io=contract, period_s=0.005)
    store = DeviceStore(tmp_path / "device")
    staged = store.staging_dir()
    bundle.extract(tmp_path / "b.tar", staged, 1 << 24)
    bundle.verify_dir(staged, signing.load_trusted([pub]))
    store.activate(store.install(staged, "cartpole", "1"))
    return store.root


def test_agent_telemetry_is_uploaded_and_collected_into_the_dataset(mlflow_server, tmp_path):
    task = load("cartpole")
    root = _cartpole_store(tmp_path)
    device = f"agent-{uuid.uuid4().hex[:8]}"
    proc, address = start_agent(root, "--listen", "udp://127.0.0.1:0", "--telemetry", "--telemetry-rows", "25",
                                "--device-id", device, "--watchdog-periods", "100000")
    robot = BatchedEnv(task, 1, params=standin.hidden_params("cartpole"), seed=3, terminate=False)
    client = AgentClient(address, tmp_path)
    sent = []
    for i in range(40):  # the robot sends observation + measured joint state, applies the agent's command
        obs, state = robot.observe()[0], np.r_[robot.qpos[0], robot.qvel[0]].astype(np.float32)
        client.sock.sendto(encode_observation(i, 0.0, obs, state), client.peer)
        while (got := decode_action(client.sock.recv(65536)))[0] != i:
            pass
        sent.append((obs, state, got[3].copy()))
        robot.step(((got[3] - task.action_default) / task.action_scale)[None])
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    pending = root / "telemetry" / "pending"
    files = sorted(pending.glob("*.npz"))
    assert len(files) == 2
    # a damaged copy: NaN in qvel.1 (state.3) at row 3 must be quarantined naming the file and field
    damaged = dict(np.load(files[0]))
    damaged["state.3"] = damaged["state.3"].copy()
    damaged["state.3"][3] = np.nan
    bad = pending / (files[0].stem[:-3] + "9-v1.npz")
    np.savez(bad, **damaged)
    r = run_cli("sim2edge-agent", "upload", "--registry", mlflow_server, "--root", str(root), "--device-id", device)
    assert r.returncode == 0, r.stderr

    ctx = standalone(mlflow_server, "sim2edge/cartpole-agent-telemetry-test", None)
    report = collect_step(ctx, Workspace(home=tmp_path / "ws"), "cartpole", "registry")
    (q,) = [q for q in report.quarantined if q.file.endswith(bad.name)]
    assert f"{bad.name}: episode 0, column 'state.3', row 3: nan is not finite" in q.reason
    manifest = json.loads((report.dataset.path / "manifest.json").read_text())
    ours = [f for f in manifest["files"] if f["device_ids"] == [device]]
    assert sorted(f["name"] for f in ours) == [f.name for f in files] and all("telemetry_sha256" in f for f in ours)
    table = pa.concat_tables([logs.read((report.dataset.path / f["path"]).resolve()) for f in ours])
    assert table.column("step").to_pylist() == list(range(40))
    assert np.allclose(logs.columns(table, "obs"), [s[0] for s in sent])
    assert np.allclose(np.c_[logs.columns(table, "qpos"), logs.columns(table, "qvel")], [s[1] for s in sent])
    assert np.allclose(logs.columns(table, "ctrl"), [s[2] for s in sent])
    assert set(table.column("policy_version").to_pylist()) == {"1"}
    again = collect_step(ctx, Workspace(home=tmp_path / "ws"), "cartpole", "registry")
    assert not again.new_version


@pytest.mark.parametrize("edit, field, message", [
    (lambda c: [c.pop(k) for k in list(c) if k.startswith("state.")], "state.0",
     "no measured joint state"),
    (lambda c: c.pop("obs.pole_sin"), "obs.pole_sin", "missing"),
    (lambda c: c.update({"obs.extra": c["step"]}), "obs.extra", "not in task 'cartpole'"),
    (lambda c: c.update({"schema_version": np.array(7)}), "schema_version", "schema version 7 is not one of 1, 2"),
    (lambda c: c.update({"time": c["time"][:-1]}), "time", "shape"),
    (lambda c: c.update({"step": c["step"] * 2}), "step", "step goes from 0 to 2"),
])
def test_bad_agent_telemetry_names_file_and_field(tmp_path, edit, field, message):
    n = 6
    cols = {"schema_version": np.array(1), "episode": np.zeros(n, np.int64), "step": np.arange(n),
            "time": np.arange(n) * 0.02, "inference_ms": np.ones(n, np.float32), "loop_ms": np.ones(n, np.float32),
            "flags": np.zeros(n, np.uint32), "policy_version": np.array(["1"] * n), "device_id": np.array(["d"] * n),
            **{f"obs.{o.name}": np.zeros(n, np.float32) for o in load("cartpole").observations},
            "act.slide": np.zeros(n, np.float32), **{f"state.{i}": np.zeros(n, np.float32) for i in range(4)}}
    edit(cols)
    path = tmp_path / "up" / "t.npz"
    path.parent.mkdir()
    np.savez(path, **cols)
    (path.parent / "cut.npz").write_bytes(path.read_bytes()[:100])
    store = DatasetStore(tmp_path / "ds", load("cartpole"), "cartpole")
    report = ingest_folder(store, path.parent)
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert "t.npz: " in reasons["t.npz"] and f"'{field}'" in reasons["t.npz"] and message in reasons["t.npz"]
    assert "unreadable or truncated .npz" in reasons["cut.npz"]
    assert report.dataset is None and not list((tmp_path / "ds" / "files").iterdir())


def _arm6_telemetry(tmp_path: Path, fmt: str = "npz", device: str = "dev") -> tuple[Path, np.ndarray]:
    """One v2 file written by the agent's Recorder from arm6's contract (its target_* inputs are commands), and the
    observations recorded; the same rows for either format."""
    task, rng, n = load("arm6"), np.random.default_rng(1), 6
    names = [o.name for o in task.observations]
    rec = telemetry.Recorder(tmp_path / "device", names, [a.name for a in task.actions], "3", device, format=fmt,
                             command_names=[o.name for o in task.observations if o.source == "command"])
    obs = rng.uniform(-0.3, 0.3, size=(n, len(names))).astype(np.float32)
    for i in range(n):
        rec.record(0, i, 1.7e9 + 0.02 * i, obs[i], rng.uniform(-0.2, 0.2, task.act_dim).astype(np.float32), 1e-4,
                   0.02, 0, rng.normal(size=task.model.nq + task.model.nv).astype(np.float32))
    return rec.flush(), obs


def test_mcap_and_npz_telemetry_of_the_same_rows_convert_to_the_same_log(tmp_path):
    task = load("arm6")
    (npz, obs), (mcap, _) = _arm6_telemetry(tmp_path / "n"), _arm6_telemetry(tmp_path / "m", "mcap")
    assert mcap.suffix == ".mcap"
    new, old = (logs.read(convert(p, task, tmp_path / f"{p.suffix[1:]}.parquet")) for p in (mcap, npz))
    assert new.column_names == old.column_names
    assert new.drop(["time"]).equals(old.drop(["time"]))  # commands, state, actions, strings: bit for bit
    assert np.allclose(new.column("time").to_numpy(), old.column("time").to_numpy(), rtol=0, atol=1e-6)  # ns stamps
    assert np.allclose(logs.columns(new, "obs"), obs)


def test_mcap_telemetry_uploaded_to_the_registry_is_collected(mlflow_server, tmp_path):
    device = f"mcap-{uuid.uuid4().hex[:8]}"
    mcap, obs = _arm6_telemetry(tmp_path, "mcap", device)
    (run_id,) = telemetry.Uploader(tmp_path / "device", mlflow_server, "arm6", device).upload()
    ctx = standalone(mlflow_server, "sim2edge/arm6-mcap-telemetry-test", None)
    report = collect_step(ctx, Workspace(home=tmp_path / "ws"), "arm6", "registry")
    assert report.quarantined == ()
    manifest = json.loads((report.dataset.path / "manifest.json").read_text())
    (ours,) = [f for f in manifest["files"] if f["device_ids"] == [device]]
    assert ours["name"] == mcap.name and "telemetry_sha256" in ours
    assert np.allclose(logs.columns(logs.read((report.dataset.path / ours["path"]).resolve()), "obs"), obs)


def test_an_mcap_that_is_not_the_agents_telemetry_is_quarantined_naming_why(tmp_path):
    mcap, _ = _arm6_telemetry(tmp_path, "mcap")
    up = tmp_path / "up"
    up.mkdir()
    (up / "cut.mcap").write_bytes(mcap.read_bytes()[:200])
    bag = up / "bag.mcap"  # a ROS 2 recording: no 'sim2edge' metadata record
    with bag.open("wb") as f:
        from mcap.writer import Writer

        w = Writer(f)
        w.start(profile="ros2", library="test")
        w.finish()
    report = ingest_folder(DatasetStore(tmp_path / "ds", load("arm6"), "arm6"), up)
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert "cut.mcap: unreadable or truncated MCAP telemetry" in reasons["cut.mcap"]
    assert "bag.mcap: no 'sim2edge' metadata record: not the agent's MCAP telemetry" in reasons["bag.mcap"]
    assert report.dataset is None


def test_command_telemetry_v2_and_v1_convert_to_the_same_log(tmp_path):
    task = load("arm6")
    v2, obs = _arm6_telemetry(tmp_path)
    cols = dict(np.load(v2))
    assert int(cols["schema_version"]) == 2 and {"cmd.target_x", "cmd.target_z"} <= set(cols)
    assert "obs.target_x" not in cols
    v1 = tmp_path / "v1.npz"  # the same rows as an agent before schema 2 wrote them: commands among obs.*
    np.savez(v1, **{**{("obs." + k[4:] if k.startswith("cmd.") else k): v for k, v in cols.items()},
                    "schema_version": np.array(1)})
    new, old = (logs.read(convert(p, task, tmp_path / f"{p.stem}.parquet")) for p in (v2, v1))
    assert new.equals(old)
    assert np.allclose(logs.columns(new, "obs"), obs) and new.column_names == old.column_names


def test_command_fields_that_are_not_the_tasks_commands_are_refused(tmp_path):
    v2, _ = _arm6_telemetry(tmp_path)
    cols = dict(np.load(v2))
    (tmp_path / "up").mkdir()
    renamed = {**cols, "cmd.goal_w": cols["cmd.target_z"]}
    del renamed["cmd.target_z"]
    np.savez(tmp_path / "up" / "renamed.npz", **renamed)
    measured = {**cols, "obs.target_y": cols["cmd.target_y"]}  # v2 with a command among obs.*
    del measured["cmd.target_y"]
    np.savez(tmp_path / "up" / "measured.npz", **measured)
    report = ingest_folder(DatasetStore(tmp_path / "ds", load("arm6"), "arm6"), tmp_path / "up")
    reasons = {Path(q.file).name: q.reason for q in report.quarantined}
    assert "renamed.npz: column 'cmd.goal_w': not a command term of task 'arm6' (its commands: cmd.target_x, " \
           "cmd.target_y, cmd.target_z)" in reasons["renamed.npz"]
    assert "measured.npz: column 'cmd.target_y': missing: task 'arm6' observes 'target_y' as a command" in \
        reasons["measured.npz"]
