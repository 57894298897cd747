"""A rosbag2 bag as log-format Parquet: its good episodes in one file, each refused one in its own, with why.

An episode is refused when a stream is stale at a tick, a value it uses is not finite, or it has under 2 ticks.

Columns come from the streams resampled onto the control period (stages/collect/resample.py): ``qpos``/``qvel``
from the joint state, ``ctrl`` from the commands, ``act`` the normalized ``clip((ctrl - default) / scale, -1, 1)``,
``obs`` the task's observation terms of the measured state, ``time`` the tick in seconds since the bag's first
message; ``episode`` numbers the bag's episodes in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from stages import logs
from stages.collect import bag_reader, resample
from stages.collect.bag_mapping import BagMapping
from stages.collect.bag_reader import BagError, BagStreams
from stages.sim.task import Task


@dataclass(frozen=True)
class BagLogs:
    log: Path | None
    """The bag's good episodes (None if it has none)."""
    refused: tuple[tuple[Path, BagError], ...]
    """Each refused episode (as resampled, NaN where stale) and its reason."""
    end_ns: int
    """The bag's end: the watermark after ingesting it."""


def observations(task: Task, qpos: np.ndarray, qvel: np.ndarray, act: np.ndarray) -> np.ndarray:
    """(T, obs_dim) the task's observation terms of the measured state (no noise or delay added)."""
    if task.commands:
        raise ValueError(f"task {task.name!r} observes commands ({', '.join(c.name for c in task.commands)}) "
                         f"that an imported log cannot supply yet")
    inputs = {"last_action": np.r_[np.zeros((1, task.act_dim)), act[:-1]].astype(np.float32)} if task.action_history else {}
    if task.sensors:
        inputs.update(task.sensor_args(task.sensordata_at(qpos, qvel)))
    return task.observe(qpos, qvel, **inputs)


def _episode(task: Task, streams: BagStreams, span: slice, mapping: BagMapping, number: int, bag: Path,
             device_id: str) -> tuple[pa.Table, BagError | None]:
    """One episode's rows, and the first reason to refuse it (None if it is good)."""
    period = round(task.ctrl_dt * 1e9)
    state, cmd = streams.state, streams.commands
    at = resample.ticks(int(state.times[span.start]), int(state.times[span.stop - 1]), period)
    where = [(state, resample.last_before(state.times, at, True), at, mapping.joint_state.max_age_s),
             (cmd, resample.last_before(cmd.times, at + period, False), at + period, mapping.commands.max_age_s)]
    error, values = None, []
    if len(at) < 2:
        error = BagError(bag, f"{len(at)} control tick; an episode needs at least 2", state.topic, "header.stamp"
                         if mapping.joint_state.stamp == "header" else "receive time", int(at[0]), streams.start_ns, number)
    for stream, index, due, max_age in where:
        bad = resample.stale(stream.times, index, due, round(max_age * 1e9))
        picked = stream.values[np.maximum(index, 0)] if len(stream.times) else np.zeros((len(at), stream.values.shape[1]))
        unusable = ~np.isfinite(picked).all(axis=1) & ~bad
        picked[bad] = np.nan
        values.append(picked)
        if unusable.any() and error is None:
            k = int(np.flatnonzero(unusable)[0])
            field, name = stream.columns[int(np.flatnonzero(~np.isfinite(picked[k]))[0])]
            error = BagError(bag, f"{name!r} is {picked[k][~np.isfinite(picked[k])][0]}, not finite", stream.topic,
                             field, int(stream.times[index[k]]), streams.start_ns, number)
        if bad.any() and error is None:
            k = int(np.flatnonzero(bad)[0])
            last = (f"the newest was {(due[k] - stream.times[index[k]]) / 1e9:.6f} s old" if index[k] >= 0
                    else "there was none yet")
            error = BagError(bag, f"stale: no message within {max_age} s before this tick ({last}); "
                                  f"{int(bad.sum())} of {len(at)} ticks stale",
                             stream.topic, stream.field, int(due[k]), streams.start_ns, number)
    m = task.model
    qpos, qvel = values[0][:, : m.nq], values[0][:, m.nq :]
    ctrl = values[1]
    act = np.clip((ctrl - task.action_default) / task.action_scale, -1, 1)
    obs = observations(task, qpos, qvel, act)
    table = logs.episode_table(number, task.ctrl_dt, [o.name for o in task.observations], [a.name for a in task.actions],
                               obs, act, ctrl, qpos, qvel, np.zeros(len(at)), mapping.policy_version, device_id)
    return table.set_column(table.column_names.index("time"), "time", pa.array((at - streams.start_ns) / 1e9)), error


def convert(bag: Path, mapping: BagMapping, task: Task, out_dir: Path, since_ns: int = 0) -> BagLogs:
    """Read ``bag`` (messages received at or after ``since_ns``) into log files under ``out_dir``."""
    streams = bag_reader.read(bag, mapping, task, since_ns)
    device_id = mapping.device_id or f"rosbag:{bag.name}"
    good, refused = [], []
    for number, span in enumerate(resample.episodes(streams.state.times, round(mapping.episodes.gap_s * 1e9))):
        table, error = _episode(task, streams, span, mapping, number, bag, device_id)
        if error is None:
            good.append(table)
            continue
        path = out_dir / f"{bag.name}-episode{number}.parquet"
        logs.write(table, path)
        refused.append((path, error))
    log = None
    if good:
        log = out_dir / f"{bag.name}.parquet"
        logs.write(pa.concat_tables(good), log)
    return BagLogs(log=log, refused=tuple(refused), end_ns=streams.end_ns)

