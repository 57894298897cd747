"""A rosbag2 bag (MCAP or SQLite3 storage, read with ``rosbags``) as the task's joint-state and command streams.

Joint states are matched to the task's MJCF joints by name (hinge and slide joints: one qpos and one qvel
each); commands to its actuators by actuator or joint name. Errors are one line naming the bag, the topic,
the field and the time (seconds since the bag's first message, and the stamp itself).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np
from rosbags.rosbag2 import Reader
from rosbags.rosbag2.errors import ReaderError
from rosbags.typesys import Stores, get_typestore

from stages.collect.bag_mapping import FLOAT64_MULTI_ARRAY, JOINT_STATE, BagMapping
from stages.collect.validate import LogError
from stages.sim.task import Task

TYPESTORE = get_typestore(Stores.ROS2_HUMBLE)
MAX_PADDING = 8
"""Trailing bytes accepted after a CDR message: rclpy pads a message ending in an empty float64 array with 4."""


class BagError(LogError):
    """A bag, or one episode of it, that must not be ingested; names the topic, field and time."""

    def __init__(self, bag: Path, detail: str, topic: str | None = None, field: str | None = None,
                 time_ns: int | None = None, start_ns: int = 0, episode: int | None = None) -> None:
        super().__init__(bag, detail, episode)
        self.topic, self.field, self.time_ns = topic, field, time_ns
        where = [f"episode {episode}" if episode is not None else "", f"topic {topic!r}" if topic else "",
                 f"field {field!r}" if field else "",
                 f"t={(time_ns - start_ns) / 1e9:.6f} s (stamp {time_ns // 10**9}.{time_ns % 10**9:09d})"
                 if time_ns is not None else ""]
        self.args = (": ".join([str(bag), *filter(None, [", ".join(filter(None, where))]), detail]),)


@dataclass(frozen=True)
class Stream:
    """One topic's messages as arrays: ``times`` (n,) int64 ns, ``values`` (n, k) in the task's order."""

    topic: str
    field: str
    times: np.ndarray
    values: np.ndarray
    columns: tuple[tuple[str, str], ...]
    """Each value column's message field and joint or actuator name."""


@dataclass(frozen=True)
class BagStreams:
    state: Stream
    """values: qpos then qvel (nq + nv)."""
    commands: Stream
    """values: ctrl (nu), the task's actuator order."""
    start_ns: int
    end_ns: int


def robot_joints(task: Task) -> dict[str, int]:
    """{MJCF joint name: its qpos (and qvel) index}; ValueError unless every joint is a hinge or slide."""
    m, out = task.model, {}
    for j in range(m.njnt):
        if m.jnt_type[j] not in (int(mujoco.mjtJoint.mjJNT_HINGE), int(mujoco.mjtJoint.mjJNT_SLIDE)):
            raise ValueError(f"task {task.name!r}: joint {m.joint(j).name!r} is not a hinge or slide joint; "
                             f"a sensor_msgs/JointState cannot carry it")
        out[m.joint(j).name] = int(m.jnt_qposadr[j])  # one qpos and one dof each: qposadr == dofadr
    return out


def actuator_names(task: Task) -> dict[str, int]:
    """{actuator name and the name of the joint it drives: actuator index}."""
    m, out = task.model, {}
    for a in range(m.nu):
        out[m.actuator(a).name] = a
        if m.actuator_trntype[a] == int(mujoco.mjtTrn.mjTRN_JOINT):
            out[m.joint(int(m.actuator_trnid[a, 0])).name] = a
    return out


def deserialize(raw: bytes | memoryview, msgtype: str) -> object:
    """A CDR message; tolerates up to ``MAX_PADDING`` trailing bytes (ValueError otherwise or when malformed)."""
    if len(raw) < 4 or bytes(raw[:2]) not in (b"\x00\x00", b"\x00\x01"):
        raise ValueError("not a CDR message (bad encapsulation header)")
    msgdef = TYPESTORE.get_msgdef(msgtype)
    read = msgdef.deserialize_cdr_le if raw[1] else msgdef.deserialize_cdr_be
    try:
        message, end = read(memoryview(raw)[4:], 0, msgdef.cls, TYPESTORE)
    except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
        raise ValueError(f"malformed {msgtype} ({e})") from None
    if len(raw) - 4 - end > MAX_PADDING:
        raise ValueError(f"{len(raw) - 4 - end} bytes after the {msgtype} message")
    return message


class NameMap:
    """Maps a message's name list onto task indices, once per distinct name list."""

    def __init__(self, known: dict[str, int], rename: dict[str, str], what: str) -> None:
        self.known, self.rename, self.what, self.cache = known, rename, what, {}

    def order(self, names: tuple[str, ...]) -> np.ndarray | str:
        """For each task index, the message index holding it; or the one-line problem."""
        if names not in self.cache:
            targets = [self.rename.get(n, n) for n in names]
            unknown = [n for n, t in zip(names, targets) if t not in self.known]
            indices = {self.known[t]: i for i, t in enumerate(targets) if t in self.known}
            missing = sorted({t for t, i in self.known.items() if i not in indices})
            self.cache[names] = (
                f"{unknown[0]!r} is not a {self.what} of the task (it has {', '.join(sorted(self.known))})" if unknown
                else f"no {self.what} {missing[0]!r} of the task" if missing
                else np.array([indices[i] for i in range(len(set(self.known.values())))]))
        return self.cache[names]


def read(bag: Path, mapping: BagMapping, task: Task, since_ns: int = 0) -> BagStreams:
    """The joint-state and command streams of ``bag`` received at or after ``since_ns``; :class:`BagError`."""
    js, cmd = mapping.joint_state, mapping.commands
    joints = robot_joints(task)
    actuators = actuator_names(task)
    if cmd.type == FLOAT64_MULTI_ARRAY:
        unknown = [n for n in cmd.names if n not in actuators]
        if unknown or sorted({actuators[n] for n in cmd.names}) != list(range(task.model.nu)) or \
                len(cmd.names) != task.model.nu:
            raise ValueError(f"mapping commands.names {list(cmd.names)}: name each of the task's {task.model.nu} "
                             f"actuators once (by actuator or joint: {', '.join(sorted(actuators))})")
    state_cols = NameMap(joints, js.rename, "joint")
    cmd_cols = NameMap(actuators, {}, "actuator")
    try:
        reader = Reader(bag)
        reader.open()
    except (ReaderError, FileNotFoundError, OSError) as e:
        raise BagError(bag, f"not a readable rosbag2 ({type(e).__name__}: {e})") from None
    try:
        start_ns, end_ns = reader.start_time, reader.end_time
        topics = reader.topics
        for topic, msgtype in ((js.topic, JOINT_STATE), (cmd.topic, cmd.type)):
            if topic not in topics:
                raise BagError(bag, f"not in the bag (topics: {', '.join(sorted(topics)) or 'none'})", topic)
            if topics[topic].msgtype != msgtype:
                raise BagError(bag, f"is {topics[topic].msgtype}, the mapping says {msgtype}", topic)
        conns = [c for c in reader.connections if c.topic in (js.topic, cmd.topic)]
        state_t, state_v, cmd_t, cmd_v = [], [], [], []
        stamp_field = "header.stamp" if js.stamp == "header" else "receive time"
        for conn, received, raw in reader.messages(conns, start=since_ns or None):
            is_state = conn.topic == js.topic
            try:
                msg = deserialize(raw, conn.msgtype)
            except ValueError as e:
                raise BagError(bag, str(e), conn.topic, None, received, start_ns) from None
            if is_state:
                t = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec if js.stamp == "header" else received
                if state_t and t < state_t[-1]:
                    raise BagError(bag, f"time goes backwards by {(state_t[-1] - t) / 1e9:.6f} s (clock jump)",
                                   conn.topic, stamp_field, t, start_ns)
                order = state_cols.order(tuple(msg.name))
                if isinstance(order, str):
                    raise BagError(bag, order, conn.topic, "name", t, start_ns)
                for field in ("position", "velocity"):
                    if len(getattr(msg, field)) != len(msg.name):
                        raise BagError(bag, f"{len(getattr(msg, field))} values for {len(msg.name)} joint names",
                                       conn.topic, field, t, start_ns)
                state_t.append(t)
                state_v.append(np.concatenate([msg.position[order], msg.velocity[order]]))
            else:
                if cmd_t and received < cmd_t[-1]:
                    raise BagError(bag, f"time goes backwards by {(cmd_t[-1] - received) / 1e9:.6f} s (clock jump)",
                                   conn.topic, "receive time", received, start_ns)
                cmd_t.append(received)
                cmd_v.append(_command(bag, msg, mapping, cmd_cols, actuators, received, start_ns))
    except ReaderError as e:
        raise BagError(bag, f"unreadable rosbag2 storage ({e})") from None
    finally:
        reader.close()
    nu, field = task.model.nu, "data" if cmd.type == FLOAT64_MULTI_ARRAY else f"points[0].{cmd.field}"
    return BagStreams(
        state=Stream(js.topic, "position", np.array(state_t, dtype=np.int64),
                     np.array(state_v).reshape(-1, task.model.nq + task.model.nv),
                     tuple((f, n) for f in ("position", "velocity") for n in sorted(joints, key=joints.get))),
        commands=Stream(cmd.topic, field, np.array(cmd_t, dtype=np.int64), np.array(cmd_v).reshape(-1, nu),
                        tuple((field, task.model.actuator(a).name) for a in range(nu))),
        start_ns=start_ns, end_ns=end_ns)


def _command(bag: Path, msg: object, mapping: BagMapping, columns: NameMap, actuators: dict[str, int],
             received: int, start_ns: int) -> np.ndarray:
    """One command message as (nu,) controls in the task's actuator order."""
    cmd = mapping.commands
    if cmd.type == FLOAT64_MULTI_ARRAY:
        if len(msg.data) != len(cmd.names):
            raise BagError(bag, f"{len(msg.data)} values, the mapping names {len(cmd.names)}", cmd.topic, "data",
                           received, start_ns)
        out = np.empty(len(cmd.names))
        out[[actuators[n] for n in cmd.names]] = msg.data
        return out
    order = columns.order(tuple(msg.joint_names))
    if isinstance(order, str):
        raise BagError(bag, order, cmd.topic, "joint_names", received, start_ns)
    if not len(msg.points) or len(values := getattr(msg.points[0], cmd.field)) != len(msg.joint_names):
        raise BagError(bag, f"no {cmd.field} for each of the {len(msg.joint_names)} joint names", cmd.topic,
                       f"points[0].{cmd.field}", received, start_ns)
    return np.asarray(values)[order]
