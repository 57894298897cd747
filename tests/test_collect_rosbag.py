"""rosbag2 in: real bags (MCAP and SQLite3, written with rosbags) made from the stand-in's own logs, ingested,
resampled, validated, and calibrated against."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.serde import SerdeError

from stages import logs, standin
from stages.collect.bag_mapping import BagMapping, load_mapping
from stages.collect.bag_reader import TYPESTORE, BagError, deserialize
from stages.collect.ingest import ingest_bag
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore, dataset_files
from stages.sim.registry import load
from stages.twin.calibrate import CalibrateConfig, calibrate
from tests.conftest import run_cli

EXAMPLE = Path(__file__).parent.parent / "examples" / "rosbag_mapping.yaml"
JS, CMD = "/joint_states", "/slide_controller/commands"
T = TYPESTORE.types
START = 1_764_928_800 * 10**9  # the bag's clock: 2025-12-05 10:00 UTC


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """Three short cart-pole episodes of the stand-in (the project's own log)."""
    return record(load("cartpole"), standin.hidden_params("cartpole"), 3, 4,
                  tmp_path_factory.mktemp("log") / "standin.parquet", "stand-in:cartpole")


def joint_state(stamp: int, names, position, velocity) -> object:
    header = T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=stamp // 10**9, nanosec=stamp % 10**9),
                                      frame_id="")
    return T["sensor_msgs/msg/JointState"](header=header, name=list(names), position=np.asarray(position, float),
                                           velocity=np.asarray(velocity, float), effort=np.zeros(0))


def command(values) -> object:
    layout = T["std_msgs/msg/MultiArrayLayout"](dim=[], data_offset=0)
    return T["std_msgs/msg/Float64MultiArray"](layout=layout, data=np.asarray(values, float))


def serialize(msg: object, msgtype: str) -> bytes:
    return bytes(TYPESTORE.serialize_cdr(msg, msgtype))


def bag_messages(path: Path, seed: int = 0, skip_commands: tuple[float, float] | None = None):
    """The log's episodes as (topic, receive ns, message bytes), 1 s apart: joint states at twice the control
    rate, sampled up to 20% of a period before the tick (the in-between ones interpolated), in a shuffled joint
    order; each command 10–60% of a period after its state. ``skip_commands`` drops commands in that (s) span."""
    table, task, rng = logs.read(path), load("cartpole"), np.random.default_rng(seed)
    dt = round(task.ctrl_dt * 1e9)
    qpos, qvel, ctrl = (logs.columns(table, p) for p in ("qpos", "qvel", "ctrl"))
    episode = table.column("episode").to_numpy()
    names = np.array(["slider", "hinge"])
    out = []
    for e in np.unique(episode):
        rows = np.flatnonzero(episode == e)
        base = START + int(e) * (len(rows) * dt + 10**9)
        for k, r in enumerate(rows):
            tick = base + k * dt
            states = [(tick - (0 if k == 0 else int(rng.uniform(0, 0.2) * dt)), qpos[r], qvel[r])]
            if k + 1 < len(rows):
                states.append((tick + dt // 2 - int(rng.uniform(0, 0.2) * dt), (qpos[r] + qpos[r + 1]) / 2,
                               (qvel[r] + qvel[r + 1]) / 2))
            for stamp, q, v in states:
                order = rng.permutation(2)
                out.append((JS, stamp + 300_000, serialize(joint_state(stamp, names[order], q[order], v[order]),
                                                           "sensor_msgs/msg/JointState")))
            sent = tick + int(rng.uniform(0.1, 0.6) * dt)
            if skip_commands is None or not skip_commands[0] <= (sent - START) / 1e9 < skip_commands[1]:
                out.append((CMD, sent, serialize(command(ctrl[r]), "std_msgs/msg/Float64MultiArray")))
    return sorted(out, key=lambda m: m[1])


def write_bag(path: Path, messages, storage: StoragePlugin = StoragePlugin.MCAP,
              types=((JS, "sensor_msgs/msg/JointState"), (CMD, "std_msgs/msg/Float64MultiArray"))) -> Path:
    with Writer(path, version=9, storage_plugin=storage) as writer:
        conns = {topic: writer.add_connection(topic, msgtype, typestore=TYPESTORE) for topic, msgtype in types}
        for topic, stamp, raw in messages:
            writer.write(conns[topic], stamp, raw)
    return path


@pytest.fixture
def mapping() -> BagMapping:
    return load_mapping(EXAMPLE)


def store(tmp_path: Path) -> DatasetStore:
    return DatasetStore(tmp_path / "datasets", load("cartpole"), "cartpole")


@pytest.mark.parametrize("storage", [StoragePlugin.MCAP, StoragePlugin.SQLITE3], ids=["mcap", "sqlite3"])
def test_bag_resamples_onto_the_logs_own_rows(storage, log, mapping, tmp_path):
    bag = write_bag(tmp_path / "run1", bag_messages(log), storage)
    s = store(tmp_path)
    report = ingest_bag(s, bag, mapping)
    assert report.quarantined == () and report.dataset.episodes == 3 and report.dataset.rows == 3 * 250
    (path,) = dataset_files(report.dataset)
    got, want = logs.read(path), logs.read(log)
    for prefix in ("qpos", "qvel", "ctrl"):
        np.testing.assert_array_equal(logs.columns(got, prefix), logs.columns(want, prefix), err_msg=prefix)
    np.testing.assert_allclose(logs.columns(got, "obs"), logs.columns(want, "obs"), atol=0.05)  # the log's obs are noisy
    assert got.column("device_id")[0].as_py() == "rosbag:run1"
    assert got.column("time")[250].as_py() == pytest.approx(250 * 0.02 + 1.0, abs=1e-3)  # s since the bag's start
    again = ingest_bag(s, bag, mapping)  # the bag's watermark: nothing new is read
    assert not again.new_version and again.added == () and again.dataset == report.dataset
    assert s.watermark(f"rosbag:{bag.resolve()}") > START


def test_single_storage_file_is_a_bag_too(log, mapping, tmp_path):
    bag = write_bag(tmp_path / "run2", bag_messages(log)[:400])
    (mcap,) = bag.glob("*.mcap")
    report = ingest_bag(store(tmp_path), mcap, mapping)
    assert report.dataset.episodes == 1 and report.quarantined == ()


def test_calibrating_from_the_bag_matches_calibrating_from_the_log(log, mapping, tmp_path):
    cfg = CalibrateConfig(max_windows=24, generations=6, search_generations=3, max_latency=1, population=6)
    from_log = calibrate(cfg, store(tmp_path / "a").ingest([log], "test").dataset, tmp_path / "twin-log")
    bag = write_bag(tmp_path / "run3", bag_messages(log, seed=3), StoragePlugin.SQLITE3)
    from_bag = calibrate(cfg, ingest_bag(store(tmp_path / "b"), bag, mapping).dataset, tmp_path / "twin-bag")
    for name, value in from_log.params.model_dump().items():
        assert getattr(from_bag.params, name) == pytest.approx(value, rel=1e-6), name
    assert from_bag.replay_error_after == pytest.approx(from_log.replay_error_after, rel=1e-6)


def test_an_episode_with_a_stale_command_stream_is_quarantined(log, mapping, tmp_path):
    bag = write_bag(tmp_path / "run4", bag_messages(log, skip_commands=(7.0, 7.3)))  # in episode 1 (6.0–11.0 s)
    s = store(tmp_path)
    report = ingest_bag(s, bag, mapping)
    assert report.dataset.episodes == 2 and report.added == (str(bag),)
    (q,) = report.quarantined
    assert q.file == str(bag)
    assert q.reason.startswith(f"{bag}: episode 1, topic '{CMD}', field 'data', t=7.0")
    assert "stale: no message within 0.03 s before this tick" in q.reason
    table = logs.read(Path(s.root / "quarantine" / f"{q.sha256[:16]}-run4-episode1.parquet"))
    assert np.isnan(table.column("ctrl.0").to_numpy()).sum() in (14, 15) and table.num_rows == 250  # 0.3 s of 0.02 s
    reason = json.loads((s.root / "quarantine" / f"{q.sha256[:16]}-run4-episode1.parquet.reason.json").read_text())
    assert reason["reason"] == q.reason


def test_an_episode_without_its_command_stream_is_quarantined(log, mapping, tmp_path):
    bag = write_bag(tmp_path / "run5", bag_messages(log, skip_commands=(12.0, 17.1)))  # all of episode 2
    report = ingest_bag(store(tmp_path), bag, mapping)
    (q,) = report.quarantined
    assert report.dataset.episodes == 2
    assert f"{bag}: episode 2, topic '{CMD}', field 'data', t=12.0197" in q.reason  # the first tick's period ends 20 ms in
    assert "the newest was 1.0" in q.reason and "250 of 250 ticks stale" in q.reason


def test_a_non_finite_joint_value_quarantines_its_episode(log, mapping, tmp_path):
    def broken(stamp):  # the hinge's velocity reads NaN from 6.5 s for 30 ms
        return serialize(joint_state(stamp - 300_000, ["hinge", "slider"], [0.1, 0.0], [np.nan, 0.0]),
                         "sensor_msgs/msg/JointState")

    messages = [(t, s, broken(s) if t == JS and 6.5e9 <= s - START < 6.53e9 else raw) for t, s, raw in bag_messages(log)]
    report = ingest_bag(store(tmp_path), write_bag(tmp_path / "nan", messages), mapping)
    (q,) = report.quarantined
    assert f"nan: episode 1, topic '{JS}', field 'velocity', t=6.5" in q.reason and "'hinge' is nan, not finite" in q.reason
    assert report.dataset.episodes == 2


def test_a_lone_joint_state_is_an_episode_too_short_to_keep(log, mapping, tmp_path):
    messages = bag_messages(log)[:300]
    lone = START + 20 * 10**9
    raw = serialize(joint_state(lone, ["hinge", "slider"], [0, 0], [0, 0]), "sensor_msgs/msg/JointState")
    report = ingest_bag(store(tmp_path), write_bag(tmp_path / "lone", [*messages, (JS, lone, raw)]), mapping)
    (q,) = report.quarantined
    assert "episode 1, topic '/joint_states', field 'header.stamp', t=19.9997" in q.reason and "at least 2" in q.reason
    assert report.dataset.episodes == 1


def _unknown_joint(messages):
    stamp = messages[5][1]
    raw = serialize(joint_state(stamp, ["slider", "elbow"], [0, 0], [0, 0]), "sensor_msgs/msg/JointState")
    return [*messages[:5], (JS, stamp, raw), *messages[6:]]


def _clock_jump(messages):
    stamp = messages[40][1]
    raw = serialize(joint_state(stamp - 10**9, ["slider", "hinge"], [0, 0], [0, 0]), "sensor_msgs/msg/JointState")
    return [*messages[:40], (JS, stamp, raw), *messages[41:]]


ERRORS = {
    "unknown-joint": (_unknown_joint, "topic '/joint_states', field 'name', t=", "'elbow' is not a joint of the task"),
    "clock-jump": (_clock_jump, "topic '/joint_states', field 'header.stamp', t=", "time goes backwards by"),
    "missing-topic": (lambda m: [x for x in m if x[0] == JS], f"topic '{CMD}': ", "not in the bag (topics: /joint_states)"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bag_errors_name_the_bag_topic_field_and_time(case, log, mapping, tmp_path):
    change, where, detail = ERRORS[case]
    types = ((JS, "sensor_msgs/msg/JointState"),) if case == "missing-topic" else None
    bag = write_bag(tmp_path / case, change(bag_messages(log)[:200]), **({"types": types} if types else {}))
    s = store(tmp_path)
    with pytest.raises(BagError, match=re.escape(detail)) as e:
        ingest_bag(s, bag, mapping)
    assert str(e.value).startswith(f"{bag}: {where}") and "\n" not in str(e.value)
    assert s.latest() is None


def test_an_unreadable_bag_is_named(mapping, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BagError, match=f"^{tmp_path / 'empty'}: not a readable rosbag2 .*metadata"):
        ingest_bag(store(tmp_path), tmp_path / "empty", mapping)


def test_padded_cdr_joint_state_is_read(mapping, tmp_path):
    """rclpy pads a JointState ending in an empty effort array with 4 bytes that rosbags alone refuses."""
    padded = serialize(joint_state(START, ["hinge", "slider"], [0.1, 0.2], [0.3, 0.4]), "sensor_msgs/msg/JointState") + bytes(4)
    with pytest.raises(SerdeError, match="size mismatch"):
        TYPESTORE.deserialize_cdr(padded, "sensor_msgs/msg/JointState")
    msg = deserialize(padded, "sensor_msgs/msg/JointState")
    assert list(msg.name) == ["hinge", "slider"] and list(msg.velocity) == [0.3, 0.4] and len(msg.effort) == 0
    with pytest.raises(ValueError, match="12 bytes after"):
        deserialize(padded + bytes(8), "sensor_msgs/msg/JointState")
    dt = 20_000_000
    messages = [m for k in range(50) for m in (
        (JS, START + k * dt, serialize(joint_state(START + k * dt, ["hinge", "slider"], [0, k * 1e-3], [0, 0.05]),
                                       "sensor_msgs/msg/JointState") + bytes(4)),
        (CMD, START + k * dt + dt // 2, serialize(command([0.5]), "std_msgs/msg/Float64MultiArray")))]
    report = ingest_bag(store(tmp_path), write_bag(tmp_path / "padded", messages), mapping)
    (path,) = dataset_files(report.dataset)
    assert logs.read(path).column("qpos.0").to_pylist()[:3] == [0, 1e-3, 2e-3]


def test_mapping_errors_name_the_file_and_key(tmp_path):
    good = yaml.safe_load(EXAMPLE.read_text())
    cases = {
        "joint_state.max_age_s: Input should be greater than 0": {**good, "joint_state": {**good["joint_state"], "max_age_s": -1}},
        "commands.type: Input should be": {**good, "commands": {**good["commands"], "type": "std_msgs/msg/String"}},
        "episodes: Field required": {k: v for k, v in good.items() if k != "episodes"},
        "joint_states: Extra inputs are not permitted": {**good, "joint_states": {}},
    }
    for message, data in cases.items():
        path = tmp_path / "robot.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ValueError, match=message) as e:
            load_mapping(path)
        assert str(e.value).startswith(f"{path}: ")


def test_joint_trajectory_commands_matched_by_joint_name(log, mapping, tmp_path):
    """trajectory_msgs/JointTrajectory setpoints: points[0].effort of each named joint is its actuator's control."""
    def trajectory(raw: bytes) -> bytes:
        ctrl = TYPESTORE.deserialize_cdr(raw, "std_msgs/msg/Float64MultiArray").data
        point = T["trajectory_msgs/msg/JointTrajectoryPoint"](
            positions=np.zeros(0), velocities=np.zeros(0), accelerations=np.zeros(0), effort=ctrl,
            time_from_start=T["builtin_interfaces/msg/Duration"](sec=0, nanosec=0))
        header = T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id="")
        return serialize(T["trajectory_msgs/msg/JointTrajectory"](header=header, joint_names=["slider"], points=[point]),
                         "trajectory_msgs/msg/JointTrajectory")

    messages = [(t, s, trajectory(raw) if t == CMD else raw) for t, s, raw in bag_messages(log)[:300]]
    bag = write_bag(tmp_path / "traj", messages, types=((JS, "sensor_msgs/msg/JointState"),
                                                         (CMD, "trajectory_msgs/msg/JointTrajectory")))
    cmd = mapping.commands.model_copy(update={"type": "trajectory_msgs/msg/JointTrajectory"})
    report = ingest_bag(store(tmp_path), bag, mapping.model_copy(update={"commands": cmd}))
    (path,) = dataset_files(report.dataset)
    got = logs.columns(logs.read(path), "ctrl")
    np.testing.assert_array_equal(got, logs.columns(logs.read(log), "ctrl")[: len(got)])


def test_collect_command_reads_a_bag(log, tmp_path):
    bag = write_bag(tmp_path / "cli", bag_messages(log))
    env, unset = {"SIM2EDGE_HOME": str(tmp_path / "ws"), "COLUMNS": "200"}, ("MLFLOW_TRACKING_URI",)
    args = ("sim2edge", "collect", "--task", "cartpole", "--source", "rosbag", "--bag", str(bag))
    out = run_cli(*args, "--mapping", str(EXAMPLE), env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert "1 new, 0 already ingested, 0 quarantined" in out.stdout
    assert "dataset cartpole v0001 (new): 3 episodes, 750 rows" in out.stdout
    out = run_cli(*args, env=env, unset=unset)
    assert out.returncode == 2 and "--source rosbag needs --bag DIR|FILE and --mapping robot.yaml" in out.stdout
