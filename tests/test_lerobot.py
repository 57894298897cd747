"""LeRobot v3.0 datasets both ways: a dataset version exported so Hugging Face ``datasets`` (what LeRobot's loader
reads data files with) loads it with the features of its ``info.json``; imported back exactly; a foreign dataset
(other element names, no velocities) imported through a mapping; each bad input named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from stages import logs
from stages.collect import lerobot_layout
from stages.collect.ingest import StandinConfig, ingest_lerobot, record_standin
from stages.collect.lerobot_layout import Feature, LeRobotEpisodes, LeRobotFormatError
from stages.collect.lerobot_logs import load_mapping, to_lerobot
from stages.collect.store import DatasetStore, dataset_files
from stages.sim.registry import load
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def cartpole():
    return load("cartpole")


@pytest.fixture(scope="module")
def recorded(cartpole, tmp_path_factory):
    """Stand-in logs of cart-pole in a store, and that version exported as a LeRobot dataset."""
    tmp = tmp_path_factory.mktemp("lerobot")
    store = DatasetStore(tmp / "store", cartpole, "cartpole")
    report = record_standin(store, StandinConfig(episodes=3, seed=4), tmp / "incoming")
    to_lerobot(report.dataset, cartpole, tmp / "export")
    return report.dataset, tmp / "export"


def frames(dataset) -> dict[str, np.ndarray]:
    tables = [logs.read(p) for p in dataset_files(dataset)]
    return {prefix: np.concatenate([logs.columns(t, prefix) for t in tables]) for prefix in ("qpos", "qvel", "ctrl", "obs")}


def test_export_has_the_v3_layout_and_loads_with_the_features_lerobot_builds(recorded, cartpole):
    datasets = pytest.importorskip("datasets")
    dataset, root = recorded
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == pytest.approx(1 / cartpole.ctrl_dt)
    assert info["total_episodes"] == 3 and info["total_frames"] == dataset.rows
    assert info["features"]["observation.qpos"]["names"] == ["slider", "hinge"]
    assert info["features"]["action"]["names"] == ["slide"]
    # what LeRobot's loader does: the data files read with the info.json features as `datasets` features
    features = datasets.Features({
        name: datasets.Value(ft["dtype"]) if ft["shape"] == [1]
        else datasets.Sequence(length=ft["shape"][0], feature=datasets.Value(ft["dtype"]))
        for name, ft in info["features"].items()})
    hf = datasets.Dataset.from_parquet(str(root / info["data_path"].format(chunk_index=0, file_index=0)),
                                       features=features)
    assert len(hf) == dataset.rows and hf.features == features
    episodes = pq.read_table(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    assert [e["length"] for e in episodes] == [e["dataset_to_index"] - e["dataset_from_index"] for e in episodes]
    assert sum(e["length"] for e in episodes) == dataset.rows and episodes[1]["tasks"] == ["cartpole"]
    row = hf[episodes[1]["dataset_from_index"]]
    assert row["episode_index"] == 1 and row["frame_index"] == 0 and row["timestamp"] == 0.0
    np.testing.assert_array_equal(np.array(hf["observation.qpos"]), frames(dataset)["qpos"])
    tasks = pq.read_table(root / "meta" / "tasks.parquet").to_pandas()
    assert tasks.index.name == "task" and list(tasks.index) == ["cartpole"] and list(tasks["task_index"]) == [0]
    stats = json.loads((root / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [dataset.rows] and len(stats["observation.state"]["mean"]) == 5


def test_an_export_imports_back_to_the_same_frames(recorded, cartpole, tmp_path):
    dataset, root = recorded
    store = DatasetStore(tmp_path / "store", cartpole, "cartpole")
    report = ingest_lerobot(store, root, load_mapping(None))
    assert not report.quarantined and len(report.added) == 3 and report.dataset.episodes == 3
    assert all(a.startswith(str(root)) for a in report.added)
    before, after = frames(dataset), frames(report.dataset)
    np.testing.assert_array_equal(after["qpos"], before["qpos"])
    np.testing.assert_array_equal(after["qvel"], before["qvel"])
    np.testing.assert_allclose(after["ctrl"], before["ctrl"], rtol=1e-6)  # float32 in the dataset, as LeRobot's
    again = ingest_lerobot(store, root, load_mapping(None))
    assert not again.new_version and len(again.duplicates) == 3


def foreign(root: Path, qpos: np.ndarray, ctrl: np.ndarray, episodes: np.ndarray, fps: float,
            names=("cart.pos", "pole.pos")) -> None:
    """A dataset as a LeRobot user records it: its own element names, joint positions only, float32."""
    feats = {"observation.state": Feature("observation.state", "float32", names),
             "action": Feature("action", "float32", ("cart.effort",))}
    lerobot_layout.write(root, LeRobotEpisodes(fps=fps, features=feats, episode_index=episodes,
                                                timestamp=np.concatenate([np.arange(n) / fps for n in
                                                                          np.unique(episodes, return_counts=True)[1]]),
                                                values={"observation.state": qpos, "action": ctrl}), "balance")


MAPPING = """
qpos: {feature: observation.state, rename: {cart.pos: slider, pole.pos: hinge}}
qvel: null
ctrl: {feature: action, rename: {cart.effort: slide}}
"""


def test_a_foreign_dataset_imports_by_name_with_velocities_by_difference(cartpole, tmp_path):
    t = np.arange(50) * cartpole.ctrl_dt
    qpos = np.stack([0.1 * np.sin(2 * t), 0.05 * np.cos(3 * t)], 1)
    foreign(tmp_path / "ds", qpos[:, ::-1].copy(), np.sin(t)[:, None], np.zeros(50, np.int64), 1 / cartpole.ctrl_dt,
            names=("pole.pos", "cart.pos"))  # stored in another order than the MJCF's
    (tmp_path / "map.yaml").write_text(MAPPING)
    report = ingest_lerobot(DatasetStore(tmp_path / "store", cartpole, "cartpole"), tmp_path / "ds",
                            load_mapping(tmp_path / "map.yaml"))
    assert not report.quarantined, report.quarantined
    got = frames(report.dataset)
    np.testing.assert_allclose(got["qpos"], qpos, atol=1e-7)
    np.testing.assert_allclose(got["qvel"][1:-1, 0], 0.2 * np.cos(2 * t[1:-1]), atol=2e-3)  # d/dt 0.1 sin 2t
    table = logs.read(dataset_files(report.dataset)[0])
    assert set(table.column("policy_version").to_pylist()) == {"demonstration"}
    assert set(table.column("device_id").to_pylist()) == {"lerobot:ds"}


def test_bad_datasets_and_mappings_are_named(cartpole, tmp_path):
    store = DatasetStore(tmp_path / "store", cartpole, "cartpole")
    (tmp_path / "map.yaml").write_text(MAPPING)
    mapping = load_mapping(tmp_path / "map.yaml")
    qpos, ctrl, eps = np.zeros((20, 2)), np.zeros((20, 1)), np.repeat([0, 1], 10)
    cases = {
        "fps": (dict(fps=30.0), r"meta/info.json: fps 30 is not the control rate of task 'cartpole' \(50 Hz\)"),
        "name": (dict(names=("cart.pos", "wrist.pos")),
                 r"features.observation.state: 'wrist.pos' is not a joint position of the task"),
    }
    for case, (change, message) in cases.items():
        foreign(tmp_path / case, qpos, ctrl, eps, **{"fps": 1 / cartpole.ctrl_dt, **change})
        with pytest.raises(LeRobotFormatError, match=message):
            ingest_lerobot(store, tmp_path / case, mapping)
    foreign(tmp_path / "old", qpos, ctrl, eps, 1 / cartpole.ctrl_dt)
    info = json.loads((tmp_path / "old" / "meta" / "info.json").read_text())
    (tmp_path / "old" / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.1"}))
    with pytest.raises(LeRobotFormatError, match=r"codebase_version 'v2.1' is not v3.x"):
        ingest_lerobot(store, tmp_path / "old", mapping)
    foreign(tmp_path / "plain", qpos, ctrl, eps, 1 / cartpole.ctrl_dt)
    with pytest.raises(LeRobotFormatError, match=r"no feature 'observation.qpos' \(it has action, "):
        ingest_lerobot(store, tmp_path / "plain", load_mapping(None))  # the defaults: what an export holds
    (tmp_path / "typo.yaml").write_text("qpos: {feature: observation.state, renme: {}}\n")
    with pytest.raises(ValueError, match=r"typo.yaml: qpos.renme: Extra inputs are not permitted"):
        load_mapping(tmp_path / "typo.yaml")
    assert store.latest() is None  # nothing ingested by any of them

    bad = qpos.copy()
    bad[13, 1] = np.nan  # episode 1 only
    foreign(tmp_path / "nan", bad, ctrl, eps, 1 / cartpole.ctrl_dt)
    report = ingest_lerobot(store, tmp_path / "nan", mapping)
    assert report.dataset.episodes == 1 and len(report.quarantined) == 1
    assert report.quarantined[0].file == str(tmp_path / "nan" / "nan-episode000001.parquet")


def test_collect_and_export_commands(recorded, tmp_path):
    _, root = recorded
    env = {"SIM2EDGE_HOME": str(tmp_path / "home")}
    done = run_cli("sim2edge", "collect", "--task", "cartpole", "--source", "lerobot", "--dataset", str(root), env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "3 new, 0 already ingested, 0 quarantined" in done.stdout
    out = tmp_path / "again"
    done = run_cli("sim2edge", "dataset", "export", "--task", "cartpole", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads((out / "meta" / "info.json").read_text())["total_episodes"] == 3
    done = run_cli("sim2edge", "dataset", "export", "--task", "cartpole", "--out", str(out), env=env)
    assert done.returncode == 1 and done.stdout.strip().splitlines()[-1].endswith("already holds a LeRobot dataset "
                                                                                  "(meta/info.json)")
