"""The agent's MCAP telemetry (``sim2edge-agent run --telemetry --telemetry-format mcap``) read with Foxglove's own
TypeScript libraries, as Foxglove opens a ``ros2`` recording: ``@mcap/core`` (indexed reading through the summary
and chunk indexes, and front to back, CRCs checked), ``@foxglove/rosmsg`` (the ``ros2msg`` schemas) and
``@foxglove/rosmsg2-serialization`` (the CDR messages), run by tests/js/read_mcap.mjs under Node (versions pinned
in tests/js/package-lock.json; ``make foxglove``, which ``make test`` runs, installs them into tests/js/node_modules).
What they decode must be what the Python ``mcap`` + ``mcap-ros2-support`` readers decode from the same files."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap.writer import Writer
from mcap_ros2.decoder import DecoderFactory

from edge import telemetry_mcap
from tests.test_agent_mcap import ROWS, STEPS, recorded  # noqa: F401  (recorded: the real agent run, a fixture)

JS = Path(__file__).parent / "js"
TOPICS = ("/sim2edge/joint_states", "/sim2edge/actions", "/sim2edge/observations", "/sim2edge/commands",
          "/sim2edge/step")
# MCAP opcodes of the summary records Foxglove's indexed reader opens a file with
SCHEMA, CHANNEL, CHUNK_INDEX, STATISTICS, METADATA_INDEX = 0x03, 0x04, 0x08, 0x0B, 0x0D


NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None or not (JS / "node_modules" / "@mcap" / "core").is_dir(),
                                reason="Foxglove's MCAP libraries are not installed (Node and `make foxglove`: "
                                       "npm ci in tests/js)")


def node_read(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([NODE, str(JS / "read_mcap.mjs"), *map(str, files)], capture_output=True, text=True,
                          timeout=60)


def plain(value):
    """A message decoded by ``mcap-ros2-support`` as JSON-like values (its messages have ``__slots__``)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "__slots__") and not isinstance(value, (int, float, str)):
        return {k: plain(getattr(value, k)) for k in value.__slots__}
    return value


@pytest.fixture(scope="module")
def both(recorded):  # noqa: F811
    """Per file name: what Foxglove's libraries read, and what the Python readers read."""
    files = recorded[0]
    r = node_read(*files)
    assert r.returncode == 0, r.stderr
    fox = {Path(f["path"]).name: f for f in json.loads(r.stdout)["files"]}
    py = {}
    for f in files:
        with open(f, "rb") as stream:
            reader = make_reader(stream, decoder_factories=[DecoderFactory()])
            summary = reader.get_summary()
            topics: dict = {}
            for schema, channel, message, decoded in reader.iter_decoded_messages(log_time_order=False):
                topics.setdefault(channel.topic, {"schema": schema.name, "messages": []})["messages"].append(
                    {"log_time": message.log_time, "publish_time": message.publish_time,
                     "sequence": message.sequence, "data": plain(decoded)})
            py[f.name] = {"header": reader.get_header(), "summary": summary, "topics": topics,
                          "metadata": [{"name": m.name, "metadata": m.metadata} for m in reader.iter_metadata()]}
    assert sorted(fox) == sorted(py) and len(fox) == 3
    return fox, py


def test_foxglove_opens_each_file_through_its_summary_as_a_ros2_recording(both):
    fox, py = both
    for name, f in fox.items():
        summary = py[name]["summary"]
        assert (f["profile"], f["library"]) == ("ros2", "sim2edge-agent") == \
            (py[name]["header"].profile, py[name]["header"].library)
        # the summary offsets let Foxglove find schemas, channels, statistics and indexes without a scan
        assert {SCHEMA, CHANNEL, CHUNK_INDEX, STATISTICS, METADATA_INDEX} <= set(f["summary_offsets"])
        assert f["chunks"] == len(summary.chunk_indexes) >= 1 and f["compression"] == ["zstd"]
        stats = f["statistics"]
        assert stats["message_count"] == summary.statistics.message_count == \
            sum(t["count"] for t in f["topics"].values()) == f["records"]["Message"]
        assert (stats["channel_count"], stats["schema_count"], stats["chunk_count"], stats["metadata_count"]) == \
            (len(TOPICS), 2, f["chunks"], 1)
        assert (int(stats["start_time"]), int(stats["end_time"])) == \
            (summary.statistics.message_start_time, summary.statistics.message_end_time)
        for topic, t in f["topics"].items():
            assert t["statistics_count"] == t["count"]
        # the metadata record, through its index, as the Python reader reads it
        assert f["metadata_indexes"] == ["sim2edge"] and f["metadata"] == py[name]["metadata"]
        assert f["metadata"][0]["metadata"].keys() == {"policy_version", "device_id", "schema_version"}
        assert f["metadata"][0]["metadata"]["device_id"] == "dev-1"
        assert f["records"]["Header"] == f["records"]["Footer"] == f["records"]["DataEnd"] == 1


def test_foxglove_parses_every_channels_ros2msg_schema(both):
    fox, _ = both
    for f in fox.values():
        assert set(f["topics"]) == set(TOPICS)
        for topic, t in f["topics"].items():
            if topic == telemetry_mcap.JOINT_STATES:
                assert t["schema"] == "sensor_msgs/msg/JointState"
                assert t["fields"] == ["std_msgs/Header header", "string[] name", "float64[] position",
                                       "float64[] velocity", "float64[] effort"]
                assert t["types"] == ["std_msgs/Header", "builtin_interfaces/Time"]
            else:
                assert t["schema"] == "std_msgs/msg/Float64MultiArray"
                assert t["fields"] == ["std_msgs/MultiArrayLayout layout", "float64[] data"]
                assert t["types"] == ["std_msgs/MultiArrayLayout", "std_msgs/MultiArrayDimension"]


def test_foxglove_decodes_every_message_as_the_python_readers_do(both, recorded):  # noqa: F811
    fox, py = both
    _, states, obs, actions = recorded
    for name, f in fox.items():
        assert {t: v["count"] for t, v in f["topics"].items()} == \
            {t: len(v["messages"]) for t, v in py[name]["topics"].items()}
        for topic, t in f["topics"].items():
            theirs, ours = t["messages"], py[name]["topics"][topic]["messages"]
            assert t["schema"] == py[name]["topics"][topic]["schema"]
            for a, b in zip(theirs, ours):
                assert (int(a["log_time"]), int(a["publish_time"]), a["sequence"]) == \
                    (b["log_time"], b["publish_time"], b["sequence"])
                assert a["data"] == b["data"], (name, topic, a["sequence"])  # field by field, values exact
    # and what Foxglove decodes is what the agent was sent and answered, across the three rotated files
    merged = {topic: [m["data"] for f in sorted(fox) for m in fox[f]["topics"][topic]["messages"]] for topic in TOPICS}
    assert all(len(v) == STEPS for v in merged.values()) and [len(fox[f]["topics"]["/sim2edge/step"]["messages"])
                                                              for f in sorted(fox)] == [ROWS, ROWS, STEPS - 2 * ROWS]
    js = merged["/sim2edge/joint_states"]
    assert js[0]["name"] == ["joint_0", "joint_1"] and js[0]["header"]["frame_id"] == ""
    assert js[0]["header"]["stamp"].keys() == {"sec", "nanosec"} and js[0]["header"]["stamp"]["sec"] > 1_700_000_000
    assert np.array([[*m["position"], *m["velocity"]] for m in js]) == pytest.approx(states, abs=0)
    assert all(m["effort"] == [] for m in js)
    assert np.array([m["data"] for m in merged["/sim2edge/actions"]]) == pytest.approx(actions, abs=0)
    assert np.array([m["data"] for m in merged["/sim2edge/observations"]]) == pytest.approx(obs[:, :3], abs=0)
    assert np.array([m["data"] for m in merged["/sim2edge/commands"]]) == pytest.approx(obs[:, 3:], abs=0)
    assert merged["/sim2edge/actions"][0]["layout"] == {"dim": [{"label": "u", "size": 1, "stride": 1}],
                                                        "data_offset": 0}


def test_foxglove_rejects_a_message_its_schema_does_not_match_and_a_cut_file(recorded, tmp_path):  # noqa: F811
    """The check has teeth: a CDR message longer than its schema reads, and a file cut before its summary."""
    bad = tmp_path / "bad.mcap"
    with open(bad, "wb") as stream:
        writer = Writer(stream)
        writer.start(profile="ros2", library="test")
        schema = writer.register_schema(telemetry_mcap.ARRAY[0], "ros2msg", telemetry_mcap.ARRAY[1].encode())
        channel = writer.register_channel("/x", "cdr", schema)
        writer.add_message(channel, 1, telemetry_mcap.array("a", np.array([1.0])) + bytes(8), 1, 0)
        writer.finish()
    r = node_read(bad)
    assert r.returncode == 1 and "/x message 0: 52 bytes, the schema reads 44" in r.stderr, r.stderr
    cut = tmp_path / "cut.mcap"
    cut.write_bytes(recorded[0][0].read_bytes()[:-100])
    r = node_read(cut)
    assert r.returncode == 1 and "cut.mcap: Error: Expected MCAP magic" in r.stderr, r.stderr
