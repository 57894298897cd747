"""One telemetry file's columns (edge/telemetry.py) as MCAP with ROS 2 message schemas, for Foxglove and ``ros2 bag``.

Every message is CDR with its ``ros2msg`` schema embedded (the MCAP ``ros2`` profile), as rosbag2's MCAP
storage writes it, for Foxglove and ``ros2 bag`` (not run here; the tests read the files with the ``mcap``
reader, ``rosbags`` and rclpy's own deserializer) and ``sim2edge collect --source rosbag``. One message per control step on each topic, logged at the step's wall-clock time:

- ``/sim2edge/joint_states`` ``sensor_msgs/msg/JointState``, in steps that carried the robot's measured
  joint state: ``position`` its first half (qpos), ``velocity`` its second half (qvel); ``name`` the ROS
  joint names where the agent knows them (``sim2edge-agent ros2``), else ``joint_<i>`` (``run``: the device
  does not know the MJCF names; a collect mapping renames them). An odd size (a joint with nq != nv) goes
  whole into ``position`` with no ``velocity``.
- ``/sim2edge/actions`` ``std_msgs/msg/Float64MultiArray``: ``act.<name>``, the actuator command sent
  (``layout.dim[0].label``: the names, comma-separated).
- ``/sim2edge/observations`` ``std_msgs/msg/Float64MultiArray``: ``obs.<name>``, the policy's measured inputs.
- ``/sim2edge/commands`` ``std_msgs/msg/Float64MultiArray``: ``cmd.<name>``, the inputs the contract marks
  ``source: command`` (what the robot was told), kept out of ``/sim2edge/observations`` as .npz keeps them out
  of ``obs.*``; written only when the contract has commands. The policy's whole input, in contract order, is
  the two topics' named values.
- ``/sim2edge/step`` ``std_msgs/msg/Float64MultiArray``: ``episode, step, inference_ms, loop_ms, flags``.

``policy_version``, ``device_id`` and ``schema_version`` are the MCAP metadata record ``sim2edge``.

CDR by hand (``Cdr``, little-endian, XCDR1 alignment; byte-identical to ``rosbags``' serializer, see
tests/test_agent_mcap.py): ``mcap-ros2-support``'s generic encoder took 1.2 s for a 3000-row file on a loaded
2-core x86 machine; by hand, with each array topic's constant prefix built once, 0.6 s, mostly ``mcap``'s own
writer (``.npz``: 20 ms), on the recorder's writer thread, not in the control loop. The container is the
``mcap`` package (pure Python, with ``zstandard`` and ``lz4`` wheels).
"""

from __future__ import annotations

import struct
from typing import IO, Dict, List, Optional

import numpy as np
from mcap.writer import Writer

SEP = "=" * 80
TIME_DEFS = f"{SEP}\nMSG: std_msgs/Header\nbuiltin_interfaces/Time stamp\nstring frame_id\n" \
            f"{SEP}\nMSG: builtin_interfaces/Time\nint32 sec\nuint32 nanosec\n"
JOINT_STATE = ("sensor_msgs/msg/JointState", "std_msgs/Header header\nstring[] name\nfloat64[] position\n"
               "float64[] velocity\nfloat64[] effort\n" + TIME_DEFS)
ARRAY = ("std_msgs/msg/Float64MultiArray", f"MultiArrayLayout layout\nfloat64[] data\n"
         f"{SEP}\nMSG: std_msgs/MultiArrayLayout\nMultiArrayDimension[] dim\nuint32 data_offset\n"
         f"{SEP}\nMSG: std_msgs/MultiArrayDimension\nstring label\nuint32 size\nuint32 stride\n")
JOINT_STATES, ACTIONS, OBSERVATIONS, COMMANDS, STEP = "/sim2edge/joint_states", "/sim2edge/actions", \
    "/sim2edge/observations", "/sim2edge/commands", "/sim2edge/step"
STEP_FIELDS = ("episode", "step", "inference_ms", "loop_ms", "flags")
METADATA = "sim2edge"  # the metadata record: policy_version, device_id, schema_version
U32 = struct.Struct("<I")


class Cdr:
    """A little-endian CDR message under construction (alignment counts from after the 4-byte header)."""

    def __init__(self) -> None:
        self.buf = bytearray(b"\x00\x01\x00\x00")

    def align(self, n: int) -> None:
        self.buf += bytes(-(len(self.buf) - 4) % n)

    def u32(self, value: int) -> None:
        self.align(4)
        self.buf += U32.pack(value)

    def string(self, text: str) -> None:
        data = text.encode()
        self.u32(len(data) + 1)
        self.buf += data + b"\x00"

    def strings(self, texts: List[str]) -> None:
        self.u32(len(texts))
        for text in texts:
            self.string(text)

    def f64s(self, values: np.ndarray) -> None:
        self.u32(len(values))
        if len(values):
            self.align(8)
            self.buf += np.asarray(values, "<f8").tobytes()


def array_prefix(label: str, size: int) -> bytes:
    """A Float64MultiArray of ``size`` values up to its data (the same for every step of a topic)."""
    msg = Cdr()
    msg.u32(1)  # layout.dim: one dimension
    msg.string(label)
    msg.u32(size)
    msg.u32(size)  # stride
    msg.u32(0)  # layout.data_offset
    msg.u32(size)
    if size:
        msg.align(8)
    return bytes(msg.buf)


def array(label: str, values: np.ndarray) -> bytes:
    """A Float64MultiArray of ``values``, its one dimension labelled ``label``."""
    return array_prefix(label, len(values)) + np.asarray(values, "<f8").tobytes()


def joint_state(stamp_ns: int, state: np.ndarray, names: Optional[List[str]] = None) -> bytes:
    """A JointState of one step's measured state (qpos then qvel; an odd size all in ``position``)."""
    half = len(state) // 2 if len(state) % 2 == 0 else len(state)
    msg = Cdr()
    msg.buf += struct.pack("<iI", stamp_ns // 10**9, stamp_ns % 10**9)
    msg.string("")  # header.frame_id
    msg.strings(names if names and len(names) == half else [f"joint_{i}" for i in range(half)])
    msg.f64s(state[:half])
    msg.f64s(state[half:])
    msg.f64s(np.zeros(0))  # effort
    return bytes(msg.buf)


def write(f: IO[bytes], cols: Dict[str, np.ndarray], joint_names: Optional[List[str]] = None) -> None:
    """Write the columns of one telemetry file (edge/telemetry.py's ``flush``: at least one row) to ``f`` as MCAP;
    ``joint_names``: of the state's halves, where known."""
    obs = [k for k in cols if k.startswith("obs.")]
    cmd = [k for k in cols if k.startswith("cmd.")]
    act = [k for k in cols if k.startswith("act.")]
    state = sorted((k for k in cols if k.startswith("state.")), key=lambda k: int(k[6:]))
    writer = Writer(f)
    writer.start(profile="ros2", library="sim2edge-agent")
    js_schema = writer.register_schema(JOINT_STATE[0], "ros2msg", JOINT_STATE[1].encode())
    array_schema = writer.register_schema(ARRAY[0], "ros2msg", ARRAY[1].encode())
    topics = (JOINT_STATES, ACTIONS, OBSERVATIONS, *((COMMANDS,) if cmd else ()), STEP)
    channels = {topic: writer.register_channel(topic, "cdr", js_schema if topic == JOINT_STATES else array_schema)
                for topic in topics}
    writer.add_metadata(METADATA, {"policy_version": str(cols["policy_version"][0]),
                                     "device_id": str(cols["device_id"][0]),
                                     "schema_version": str(int(cols["schema_version"]))})
    rows = {topic: (array_prefix(",".join(names), len(names)), np.stack(columns, axis=1).astype("<f8"))
            for topic, names, columns in (
                (ACTIONS, [k[4:] for k in act], [cols[k] for k in act]),
                (OBSERVATIONS, [k[4:] for k in obs], [cols[k] for k in obs]),
                *(((COMMANDS, [k[4:] for k in cmd], [cols[k] for k in cmd]),) if cmd else ()),
                (STEP, list(STEP_FIELDS), [cols[k] for k in STEP_FIELDS]))}
    state_v = np.stack([cols[k] for k in state], axis=1) if state else None
    for i, t in enumerate(cols["time"]):
        stamp = int(round(float(t) * 1e9))
        if state_v is not None and not np.isnan(state_v[i]).any():
            writer.add_message(channels[JOINT_STATES], stamp, joint_state(stamp, state_v[i], joint_names), stamp, i)
        for topic, (prefix, values) in rows.items():
            writer.add_message(channels[topic], stamp, prefix + values[i].tobytes(), stamp, i)
    writer.finish()
