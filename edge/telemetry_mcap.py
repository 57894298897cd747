"""One telemetry file's columns (edge/telemetry.py) as MCAP with ROS 2 message schemas, for Foxglove and ``ros2 bag``.

Every message is CDR with its ``ros2msg`` schema embedded (the MCAP ``ros2`` profile), so the file opens in
Foxglove, ``ros2 bag info/play`` and ``rosbags`` (hence ``sim2edge collect --source rosbag``) without a
workspace. One message per control step on each topic, logged at the step's wall-clock time:

- ``/sim2edge/joint_states`` ``sensor_msgs/msg/JointState``, in steps that carried the robot's measured
  joint state: ``name`` ``joint_<i>``, ``position`` its first half (qpos), ``velocity`` its second half
  (qvel) — the device does not know the MJCF joint names; a collect mapping renames ``joint_<i>``. An odd
  size (a joint with nq != nv) goes whole into ``position`` with no ``velocity``.
- ``/sim2edge/actions`` ``std_msgs/msg/Float64MultiArray``: ``act.<name>``, the actuator command sent
  (``layout.dim[0].label``: the names, comma-separated).
- ``/sim2edge/observations`` ``std_msgs/msg/Float64MultiArray``: ``obs.<name>``, the policy's input.
- ``/sim2edge/step`` ``std_msgs/msg/Float64MultiArray``: ``episode, step, inference_ms, loop_ms, flags``.

``policy_version``, ``device_id`` and ``schema_version`` are the MCAP metadata record ``sim2edge``.
Serialization: ``mcap-ros2-support`` (pure Python, needs only ``mcap``; CPython >= 3.7).
"""

from __future__ import annotations

from typing import IO, Dict, List

import numpy as np
from mcap_ros2.writer import Writer

SEP = "=" * 80
TIME_DEFS = f"{SEP}\nMSG: std_msgs/Header\nbuiltin_interfaces/Time stamp\nstring frame_id\n" \
            f"{SEP}\nMSG: builtin_interfaces/Time\nint32 sec\nuint32 nanosec\n"
JOINT_STATE = ("sensor_msgs/msg/JointState", "std_msgs/Header header\nstring[] name\nfloat64[] position\n"
               "float64[] velocity\nfloat64[] effort\n" + TIME_DEFS)
ARRAY = ("std_msgs/msg/Float64MultiArray", f"MultiArrayLayout layout\nfloat64[] data\n"
         f"{SEP}\nMSG: std_msgs/MultiArrayLayout\nMultiArrayDimension[] dim\nuint32 data_offset\n"
         f"{SEP}\nMSG: std_msgs/MultiArrayDimension\nstring label\nuint32 size\nuint32 stride\n")
JOINT_STATES, ACTIONS, OBSERVATIONS, STEP = "/sim2edge/joint_states", "/sim2edge/actions", "/sim2edge/observations", \
    "/sim2edge/step"
STEP_FIELDS = ("episode", "step", "inference_ms", "loop_ms", "flags")


def _array(names: List[str], values: np.ndarray) -> dict:
    """A Float64MultiArray message (as a dict) of ``values`` labelled with ``names``."""
    dim = {"label": ",".join(names), "size": len(names), "stride": len(names)}
    return {"layout": {"dim": [dim], "data_offset": 0}, "data": [float(v) for v in values]}


def joint_state(stamp_ns: int, state: np.ndarray) -> dict:
    """A JointState message (as a dict) of one step's measured state (qpos then qvel)."""
    half = len(state) // 2 if len(state) % 2 == 0 else len(state)
    return {"header": {"stamp": {"sec": stamp_ns // 10**9, "nanosec": stamp_ns % 10**9}, "frame_id": ""},
            "name": [f"joint_{i}" for i in range(half)], "position": [float(v) for v in state[:half]],
            "velocity": [float(v) for v in state[half:]], "effort": []}


def write(f: IO[bytes], cols: Dict[str, np.ndarray]) -> None:
    """Write the columns of one telemetry file (edge/telemetry.py's ``flush``: at least one row) to ``f`` as MCAP."""
    obs = [k for k in cols if k.startswith("obs.")]
    act = [k for k in cols if k.startswith("act.")]
    state = sorted((k for k in cols if k.startswith("state.")), key=lambda k: int(k[6:]))
    writer = Writer(f)
    js_schema, array_schema = writer.register_msgdef(*JOINT_STATE), writer.register_msgdef(*ARRAY)
    writer.add_metadata("sim2edge", {"policy_version": str(cols["policy_version"][0]),
                                     "device_id": str(cols["device_id"][0]),
                                     "schema_version": str(int(cols["schema_version"]))})
    obs_v, act_v = np.stack([cols[k] for k in obs], axis=1), np.stack([cols[k] for k in act], axis=1)
    state_v = np.stack([cols[k] for k in state], axis=1) if state else None
    step_v = np.stack([cols[k].astype(np.float64) for k in STEP_FIELDS], axis=1)
    obs_names, act_names = [k[4:] for k in obs], [k[4:] for k in act]
    for i, t in enumerate(cols["time"]):
        stamp = int(round(float(t) * 1e9))
        if state_v is not None and not np.isnan(state_v[i]).any():
            writer.write_message(JOINT_STATES, js_schema, joint_state(stamp, state_v[i]), stamp, sequence=i)
        writer.write_message(ACTIONS, array_schema, _array(act_names, act_v[i]), stamp, sequence=i)
        writer.write_message(OBSERVATIONS, array_schema, _array(obs_names, obs_v[i]), stamp, sequence=i)
        writer.write_message(STEP, array_schema, _array(list(STEP_FIELDS), step_v[i]), stamp, sequence=i)
    writer.finish()
