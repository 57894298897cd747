"""``sim2edge-agent run --telemetry --telemetry-format mcap``: rotating MCAP files with ROS 2 schemas that the
``mcap`` reader opens and ``collect`` reads like any bag."""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
import yaml
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory

from edge import telemetry, telemetry_mcap
from edge.control import decode_action, encode_observation
from edge.errors import CheckFailed
from stages.collect import bag_reader
from stages.collect.bag_mapping import load_mapping
from stages.collect.ingest import ingest_bag
from stages.collect.store import DatasetStore
from stages.sim.registry import load
from tests.bundles import COMMAND_IO, active_store
from tests.conftest import run_cli
from tests.test_agent_run import Client, start

MAPPING = {"joint_state": {"topic": "/sim2edge/joint_states", "stamp": "header", "max_age_s": 0.1,
                           "rename": {"joint_0": "slider", "joint_1": "hinge"}},
           "commands": {"topic": "/sim2edge/actions", "type": "std_msgs/msg/Float64MultiArray", "names": ["slide"],
                        "max_age_s": 0.1},
           "episodes": {"gap_s": 0.5}}
STEPS, ROWS = 25, 10


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A real agent run paced at the cart-pole's control period: the .mcap files, the joint states and
    observations sent (the last two are commands, COMMAND_IO), and the actions received."""
    tmp = tmp_path_factory.mktemp("mcap")
    root = active_store(tmp, period_s=0.005, io=COMMAND_IO)
    proc, address = start(root, "--listen", "udp://127.0.0.1:0", "--telemetry", "--telemetry-format", "mcap",
                          "--telemetry-rows", str(ROWS), "--device-id", "dev-1", "--watchdog-periods", "100000")
    client = Client(address, tmp)
    rng = np.random.default_rng(0)
    states = rng.normal(size=(STEPS, 4)).astype(np.float32)  # qpos (slider, hinge) then qvel
    obs = rng.uniform(-0.2, 0.2, size=(STEPS, 5)).astype(np.float32)
    actions = []
    for i in range(STEPS):
        client.sock.sendto(encode_observation(i, time.monotonic(), obs[i], states[i]), client.peer)
        seq, _, _, values = decode_action(client.sock.recv(65536))
        assert seq == i
        actions.append(values.copy())
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["telemetry_files"] == 3
    files = telemetry.pending(root / "telemetry" / "pending")
    return files, states, obs, np.array(actions)


def test_mcap_files_rotate_and_hold_ros2_schemas_one_message_per_step(recorded):
    files, states, obs, actions = recorded
    assert [f.suffix for f in files] == [".mcap"] * 3 and all(f.stem.endswith("-v1") for f in files)
    per_topic: dict = {}
    for f in files:
        with open(f, "rb") as stream:
            reader = make_reader(stream, decoder_factories=[DecoderFactory()])
            summary = reader.get_summary()
            assert {(s.name, s.encoding) for s in summary.schemas.values()} == \
                {("sensor_msgs/msg/JointState", "ros2msg"), ("std_msgs/msg/Float64MultiArray", "ros2msg")}
            assert {c.message_encoding for c in summary.channels.values()} == {"cdr"}
            (meta,) = list(reader.iter_metadata())
            assert meta.name == "sim2edge" and meta.metadata["policy_version"] == "1" and \
                meta.metadata["device_id"] == "dev-1"
            for _, channel, _, msg in reader.iter_decoded_messages():
                per_topic.setdefault(channel.topic, []).append(msg)
    assert {t: len(m) for t, m in per_topic.items()} == {t: STEPS for t in (
        "/sim2edge/joint_states", "/sim2edge/actions", "/sim2edge/observations", "/sim2edge/commands",
        "/sim2edge/step")}
    assert np.array([m.data for m in per_topic["/sim2edge/actions"]]) == pytest.approx(actions, abs=0)
    assert per_topic["/sim2edge/actions"][0].layout.dim[0].label == "u"
    # the commands the robot was told are on their own topic, not among the measured observations
    assert per_topic["/sim2edge/observations"][0].layout.dim[0].label == "a,b,c"
    assert np.array([m.data for m in per_topic["/sim2edge/observations"]]) == pytest.approx(obs[:, :3], abs=0)
    assert per_topic["/sim2edge/commands"][0].layout.dim[0].label == "d,e"
    assert np.array([m.data for m in per_topic["/sim2edge/commands"]]) == pytest.approx(obs[:, 3:], abs=0)
    js = per_topic["/sim2edge/joint_states"]
    assert js[0].name == ["joint_0", "joint_1"]
    assert np.array([[*m.position, *m.velocity] for m in js]) == pytest.approx(states, abs=0)
    step = np.array([m.data for m in per_topic["/sim2edge/step"]])
    assert (step[:, 1] == np.arange(STEPS)).all() and (step[:, 0] == 0).all() and (step[:, 2] > 0).all()


def test_collect_reads_the_agents_mcap_like_any_bag(recorded, tmp_path):
    files, states, _, actions = recorded
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(MAPPING))
    mapping, task = load_mapping(path), load("cartpole")
    streams = [bag_reader.read(f, mapping, task) for f in files]
    assert np.concatenate([s.state.values for s in streams]) == pytest.approx(states, abs=0)
    assert np.concatenate([s.commands.values for s in streams]) == pytest.approx(actions, abs=0)
    stamps = np.concatenate([s.state.times for s in streams])
    # header stamps: the steps' wall-clock times, the client's 20 ms pacing plus each observation's wait for the
    # agent's next 5 ms tick (up to ~11 ms more on a loaded host, so one gap can be 14 ms: the median is the check)
    assert (np.diff(stamps) > 0).all() and np.median(np.diff(stamps)) > 0.015e9
    report = ingest_bag(DatasetStore(tmp_path / "datasets", task, "cartpole"), files[0], mapping)
    assert report.dataset.episodes == 1 and report.quarantined == ()


def test_a_bad_telemetry_format_is_one_line(tmp_path):
    r = run_cli("sim2edge-agent", "run", "--root", str(tmp_path), "--telemetry", "--telemetry-format", "csv")
    assert r.returncode == 2 and "argument --telemetry-format: invalid choice: 'csv'" in r.stderr
    with pytest.raises(CheckFailed, match="^telemetry: format 'csv' is not one of npz, mcap$"):
        telemetry.Recorder(tmp_path, ["a"], ["u"], "1", "dev", format="csv")


@pytest.mark.ros2
def test_rclpy_deserializes_the_recorded_messages(recorded):
    """ROS 2's own type support (what ``ros2 bag`` uses) reads the agent's CDR as the schemas it names."""
    pytest.importorskip("rclpy", reason="ROS 2 wheels not installed (pip install '.[ros2]')")
    from rclpy.serialization import deserialize_message
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    files, states, _, actions = recorded
    types = {"sensor_msgs/msg/JointState": JointState, "std_msgs/msg/Float64MultiArray": Float64MultiArray}
    got: dict = {}
    with open(files[0], "rb") as stream:
        for schema, channel, message in make_reader(stream).iter_messages():
            got.setdefault(channel.topic, []).append(deserialize_message(message.data, types[schema.name]))
    js = got["/sim2edge/joint_states"]
    assert np.array([[*m.position, *m.velocity] for m in js]) == pytest.approx(states[:ROWS], abs=0)
    assert js[1].header.stamp.sec > 1_700_000_000 and list(js[0].name) == ["joint_0", "joint_1"]
    assert np.array([list(m.data) for m in got["/sim2edge/actions"]]) == pytest.approx(actions[:ROWS], abs=0)



@pytest.mark.parametrize("state", [[1.0, -2.0, 3.5, 4.0], [1.0, 2.0, 3.0], []], ids=["even", "odd", "empty"])
def test_hand_cdr_matches_rosbags_serializer_byte_for_byte(state):
    """The agent's CDR is what rosbags' own serializer writes for the same messages (an odd state: all position)."""
    state, types, stamp = np.array(state), bag_reader.TYPESTORE.types, 1_700_000_000_250_000_000
    half = len(state) // 2 if len(state) % 2 == 0 else len(state)
    header = types["std_msgs/msg/Header"](stamp=types["builtin_interfaces/msg/Time"](sec=1_700_000_000,
                                                                                      nanosec=250_000_000), frame_id="")
    js = types["sensor_msgs/msg/JointState"](header=header, name=[f"joint_{i}" for i in range(half)],
                                             position=state[:half], velocity=state[half:], effort=np.zeros(0))
    assert telemetry_mcap.joint_state(stamp, state) == \
        bytes(bag_reader.TYPESTORE.serialize_cdr(js, "sensor_msgs/msg/JointState"))
    dim = types["std_msgs/msg/MultiArrayDimension"](label="a,b", size=len(state), stride=len(state))
    arr = types["std_msgs/msg/Float64MultiArray"](layout=types["std_msgs/msg/MultiArrayLayout"](dim=[dim],
                                                                                               data_offset=0), data=state)
    assert telemetry_mcap.array("a,b", state) == \
        bytes(bag_reader.TYPESTORE.serialize_cdr(arr, "std_msgs/msg/Float64MultiArray"))


def test_upload_sends_mcap_files_like_npz_ones(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    rec = telemetry.Recorder(tmp_path, ["a"], ["u"], "4", "dev-m", rows_per_file=2, format="mcap")
    for i in range(3):
        rec.record(0, i, 1.7e9 + i, np.array([i], np.float32), np.array([0.5], np.float32), 1e-4, 0.02, 0)
    rec.flush()
    files = telemetry.pending(tmp_path / "telemetry" / "pending")
    assert len(files) == 2 and rec.pending_bytes() == sum(f.stat().st_size for f in files) > 0
    (run_id,) = telemetry.Uploader(tmp_path, mlflow_server, f"mcap-{tmp_path.name}", "dev-m").upload()
    listed = MlflowClient(mlflow_server).list_artifacts(run_id, "telemetry")
    assert sorted(a.path.split("/")[-1] for a in listed) == [f.name for f in files]
    assert telemetry.pending(tmp_path / "telemetry" / "pending") == []
