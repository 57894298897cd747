"""Validation of one log file against a task's spec; errors name the file, episode, column and row."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from stages import logs
from stages.sim.task import Task


class LogError(ValueError):
    """A log file that must not be ingested. ``row`` is the 0-based row in the file."""

    def __init__(self, file: Path, detail: str, episode: int | None = None, column: str | None = None,
                 row: int | None = None) -> None:
        self.file, self.detail, self.episode, self.column, self.row = file, detail, episode, column, row
        where = [f"episode {episode}" if episode is not None else "", f"column {column!r}" if column else "",
                 f"row {row}" if row is not None else ""]
        super().__init__(": ".join([str(file), *filter(None, [", ".join(filter(None, where))]), detail]))


@dataclass(frozen=True)
class LogSummary:
    rows: int
    episodes: int
    time_range_s: tuple[float, float]
    device_ids: tuple[str, ...]
    policy_versions: tuple[str, ...]


def task_columns(task: Task) -> list[str]:
    m = task.model
    return logs.expected_columns([o.name for o in task.observations], [a.name for a in task.actions], m.nu, m.nq, m.nv)


def _read(path: Path) -> pa.Table:
    try:
        return logs.read(path)
    except (pa.ArrowException, OSError) as e:  # before ValueError: ArrowInvalid is one
        raise LogError(path, f"unreadable or truncated Parquet ({e})") from None
    except ValueError as e:  # unknown schema version
        raise LogError(path, str(e).removeprefix(f"{path}: ")) from None


def validate(path: Path, task: Task) -> LogSummary:
    """Check ``path`` against ``task``; raise :class:`LogError` on the first problem found."""
    table = _read(path)
    expected = task_columns(task)
    for column in expected:
        if column not in table.column_names:
            raise LogError(path, f"missing; task {task.name!r} logs {len(expected)} columns ({', '.join(expected[:6])}, …)",
                           column=column)
    for column in table.column_names:
        if column not in expected:
            m = task.model
            raise LogError(path, f"not in task {task.name!r}'s spec (obs {task.obs_dim}, act {task.act_dim}, "
                                 f"nu {m.nu}, nq {m.nq}, nv {m.nv})", column=column)
    if table.num_rows == 0:
        raise LogError(path, "no rows")
    episode = table.column("episode").to_numpy()
    for column in expected:
        if column in logs.STRING_COLUMNS:
            if not pat.is_string(table.schema.field(column).type):
                raise LogError(path, f"type {table.schema.field(column).type} is not a string", column=column)
            continue
        kind = table.schema.field(column).type
        if not (pat.is_floating(kind) or pat.is_integer(kind)):
            raise LogError(path, f"type {kind} is not numeric", column=column)
        values = table.column(column).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(~np.isfinite(values.astype(np.float64)))
        if len(bad):
            row = int(bad[0])
            raise LogError(path, f"{values[row]} is not finite ({len(bad)} such rows)", int(episode[row]), column, row)
    starts = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    ends = np.r_[starts[1:], len(episode)]
    if len(np.unique(episode)) != len(starts):
        row = int(next(s for s in starts[1:] if episode[s] in episode[: s]))
        raise LogError(path, "rows of this episode are not contiguous", int(episode[row]), "episode", row)
    step, time = table.column("step").to_numpy(), table.column("time").to_numpy()
    for s, e in zip(starts, ends):
        if e - s < 2:
            raise LogError(path, f"episode has {e - s} row; at least 2 are needed", int(episode[s]), "episode", int(s))
        if (gap := np.flatnonzero(np.diff(step[s:e]) != 1)).size:
            row = int(s + gap[0] + 1)
            raise LogError(path, f"step goes from {step[row - 1]} to {step[row]} (rows dropped or reordered)",
                           int(episode[s]), "step", row)
        if (back := np.flatnonzero(np.diff(time[s:e]) <= 0)).size:
            row = int(s + back[0] + 1)
            raise LogError(path, f"time goes backwards or stalls: {time[row - 1]} then {time[row]}",
                           int(episode[s]), "time", row)
    return LogSummary(
        rows=table.num_rows, episodes=len(starts), time_range_s=(float(time.min()), float(time.max())),
        device_ids=tuple(sorted(set(table.column("device_id").to_pylist()))),
        policy_versions=tuple(sorted(set(table.column("policy_version").to_pylist()))),
    )
