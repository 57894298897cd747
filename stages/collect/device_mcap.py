"""The agent's MCAP telemetry (edge/telemetry_mcap.py) read back into the fields of its ``.npz`` telemetry.

The agent writes one message per control step on each ``/sim2edge/*`` topic, its row number as the message's
sequence, and the file's ``policy_version``, ``device_id`` and ``schema_version`` as the metadata record
``sim2edge``. This reads them into the columns ``device_logs.convert`` takes from an ``.npz`` (``episode``,
``step``, ``time``, ``obs.*``, ``cmd.*``, ``act.*``, ``state.*``, …), so both formats reach a dataset through one
conversion and one set of checks. A step without a ``JointState`` message has NaN state, as in the ``.npz``.
Messages are decoded with ``rosbags``' typestore (the one the bag reader uses). Errors name the file and topic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mcap.exceptions import McapError
from mcap.reader import make_reader

from edge.telemetry_mcap import ACTIONS, COMMANDS, JOINT_STATES, METADATA, OBSERVATIONS, STEP, STEP_FIELDS
from stages.collect.bag_reader import TYPESTORE
from stages.collect.validate import LogError

ARRAYS = {ACTIONS: "act", OBSERVATIONS: "obs", COMMANDS: "cmd"}


def read_mcap(path: Path) -> dict[str, np.ndarray]:
    """The telemetry fields of one agent MCAP file, or :class:`LogError` naming the file and what is wrong."""
    try:
        with path.open("rb") as f:
            reader = make_reader(f)
            meta = next((m.metadata for m in reader.iter_metadata() if m.name == METADATA), None)
            if meta is None:
                raise LogError(path, f"no {METADATA!r} metadata record: not the agent's MCAP telemetry (a rosbag2 "
                                     f"recording goes through `collect --source rosbag`)")
            messages = [(c.topic, s.name, m.sequence, m.log_time, m.data) for s, c, m in reader.iter_messages()]
    except (McapError, OSError, ValueError, EOFError) as e:
        raise LogError(path, f"unreadable or truncated MCAP telemetry ({type(e).__name__}: {e})") from None
    rows = [m for m in messages if m[0] == STEP]
    if not rows:
        raise LogError(path, f"no {STEP} messages: an agent file has one per control step")
    n = len(rows)
    if sorted(m[2] for m in rows) != list(range(n)):
        raise LogError(path, f"{STEP}: message sequences are not the rows 0…{n - 1}, one each")
    cols: dict[str, np.ndarray] = {}
    for topic, msgtype, seq, log_time, data in messages:
        if not 0 <= seq < n:
            raise LogError(path, f"{topic}: message sequence {seq} is outside the file's {n} steps")
        msg = _decode(path, topic, msgtype, data)
        if topic == STEP:
            for name, value in zip(STEP_FIELDS, _values(path, topic, msg.data, len(STEP_FIELDS))):
                cols.setdefault(name, np.full(n, np.nan))[seq] = value
            cols.setdefault("time", np.full(n, np.nan))[seq] = log_time / 1e9
        elif topic in ARRAYS:
            labels = msg.layout.dim[0].label.split(",") if msg.layout.dim and msg.layout.dim[0].label else []
            for name, value in zip(labels, _values(path, topic, msg.data, len(labels))):
                cols.setdefault(f"{ARRAYS[topic]}.{name}", np.full(n, np.nan))[seq] = value
        elif topic == JOINT_STATES:
            state = np.concatenate([msg.position, msg.velocity])
            for i, value in enumerate(state):
                cols.setdefault(f"state.{i}", np.full(n, np.nan))[seq] = value
    for name in ("episode", "step", "flags"):
        cols[name] = cols[name].astype(np.int64)
    cols["policy_version"] = np.array([meta.get("policy_version", "")] * n)
    cols["device_id"] = np.array([meta.get("device_id", "")] * n)
    try:
        cols["schema_version"] = np.array(int(meta.get("schema_version", "")))
    except ValueError:
        raise LogError(path, f"metadata {METADATA!r}: schema_version {meta.get('schema_version')!r} is not an "
                             f"integer", column="schema_version") from None
    return cols


def _decode(path: Path, topic: str, msgtype: str, data: bytes):
    try:
        return TYPESTORE.deserialize_cdr(data, msgtype)
    except Exception as e:  # rosbags raises plain exceptions of several kinds on bad CDR
        raise LogError(path, f"{topic}: cannot decode a {msgtype} message ({type(e).__name__}: {e})") from None


def _values(path: Path, topic: str, data: np.ndarray, expected: int) -> np.ndarray:
    if len(data) != expected:
        raise LogError(path, f"{topic}: a message has {len(data)} values for {expected} names")
    return data
