"""The agent's telemetry (edge/telemetry.py: ``.npz``, or ``.mcap`` read by ``device_mcap``) converted into the
Parquet log format.

A telemetry file holds what the device saw and did: ``episode``, ``step``, ``time``,
``obs.<name>``, ``act.<name>`` (the actuator command it sent), ``inference_ms``, ``loop_ms``,
``policy_version``, ``device_id``, ``flags``, and ``state.<i>`` when the robot sent its measured joint
state with each observation. Schema version 2 records the observation terms the task marks
``source="command"`` as ``cmd.<name>`` (version 1: ``obs.<name>``); both become the log's ``obs.<name>``, and a
v2 file whose ``cmd.*`` fields are not the task's commands is refused. In the log format: ``ctrl.<i>`` is that
command (the task's actuator order), ``act.<name>`` the normalized action ``clip((ctrl - default) / scale, -1, 1)``, and
``qpos.*``/``qvel.*`` the joint state split by the task's ``nq``/``nv``. The joint state is required:
calibration replays it. Errors name the file and the field.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from stages import logs
from stages.collect.device_mcap import read_mcap
from stages.collect.validate import LogError
from stages.sim.task import Task

TELEMETRY_SUFFIXES = (".npz", ".mcap")
TELEMETRY_SCHEMA_VERSIONS = (1, 2)  # edge.telemetry.SCHEMA_VERSION: 2 records commands as cmd.<name>
_SCALARS = ("episode", "step", "time", "inference_ms", "loop_ms")
_EXTRA = ("flags", "schema_version")  # device-only fields that have no log column


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """A telemetry file's fields (no pickle), or :class:`LogError`."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise LogError(path, f"unreadable or truncated .npz telemetry ({type(e).__name__}: {e})") from None


def convert(path: Path, task: Task, out: Path) -> Path:
    """Write ``path`` (agent telemetry, ``.npz`` or ``.mcap``) as a log-format Parquet file ``out``; :class:`LogError`
    on bad input."""
    cols = read_mcap(path) if path.suffix == ".mcap" else read_npz(path)
    version = cols.get("schema_version")
    if version is None or version.shape != () or int(version) not in TELEMETRY_SCHEMA_VERSIONS:
        raise LogError(path, f"telemetry schema version {version} is not one of "
                             f"{', '.join(map(str, TELEMETRY_SCHEMA_VERSIONS))}", column="schema_version")
    act_names = [a.name for a in task.actions]
    obs_fields = observation_fields(task, int(version))
    if int(version) >= 2:
        _check_commands(path, cols, task, obs_fields)
    m = task.model
    needed = [*_SCALARS, *obs_fields.values(), *(f"act.{n}" for n in act_names), *logs.STRING_COLUMNS]
    for field in needed:
        if field not in cols:
            raise LogError(path, f"missing; agent telemetry of task {task.name!r} has {', '.join(needed[:6])}, …",
                           column=field)
    state = sorted((k for k in cols if k.startswith("state.")), key=lambda k: int(k[6:]) if k[6:].isdigit() else -1)
    for field in cols:
        if field not in needed and field not in _EXTRA and field not in state:
            raise LogError(path, f"not in task {task.name!r}'s spec (obs {task.obs_dim}, act {task.act_dim})",
                           column=field)
    if not state:
        raise LogError(path, f"no measured joint state: the robot must append qpos+qvel ({m.nq}+{m.nv} values) to "
                             f"each observation (edge/control.py wire format); calibration replays it",
                       column="state.0")
    if [f"state.{i}" for i in range(len(state))] != state or len(state) != m.nq + m.nv:
        raise LogError(path, f"joint state has fields {state[0]}…{state[-1]}; task {task.name!r} needs "
                             f"state.0…state.{m.nq + m.nv - 1} (nq {m.nq} + nv {m.nv})", column=state[-1])
    rows = len(cols["step"])
    for field in [*needed, *state]:
        if cols[field].shape != (rows,):
            raise LogError(path, f"shape {cols[field].shape}, expected ({rows},) like 'step'", column=field)
        if field not in logs.STRING_COLUMNS and not np.issubdtype(cols[field].dtype, np.number):
            raise LogError(path, f"type {cols[field].dtype} is not numeric", column=field)
    ctrl = np.stack([cols[f"act.{n}"] for n in act_names], axis=1).astype(np.float64)
    action = np.clip((ctrl - task.action_default) / task.action_scale, -1, 1)
    joint = np.stack([cols[k] for k in state], axis=1).astype(np.float64)
    table = {
        "episode": cols["episode"].astype(np.int64), "step": cols["step"].astype(np.int64),
        "time": cols["time"].astype(np.float64),
        **{f"obs.{n}": cols[field].astype(np.float32) for n, field in obs_fields.items()},
        **{f"act.{n}": action[:, i].astype(np.float32) for i, n in enumerate(act_names)},
        **{f"ctrl.{i}": ctrl[:, i] for i in range(m.nu)},
        **{f"qpos.{i}": joint[:, i] for i in range(m.nq)},
        **{f"qvel.{i}": joint[:, m.nq + i] for i in range(m.nv)},
        "inference_ms": cols["inference_ms"].astype(np.float32), "loop_ms": cols["loop_ms"].astype(np.float32),
        **{k: [str(v) for v in cols[k]] for k in logs.STRING_COLUMNS},
    }
    logs.write(pa.table(table), out)
    return out


def observation_fields(task: Task, version: int) -> dict[str, str]:
    """Each observation term's telemetry field in schema ``version``: ``cmd.<name>`` for a command (from 2)."""
    return {o.name: f"{'cmd' if version >= 2 and o.source == 'command' else 'obs'}.{o.name}" for o in task.observations}


def _check_commands(path: Path, cols: dict[str, np.ndarray], task: Task, obs_fields: dict[str, str]) -> None:
    """Refuse a v2 file whose ``cmd.*`` fields are not the task's command terms, naming the first that differs."""
    commands = [f for f in obs_fields.values() if f.startswith("cmd.")]
    for field in cols:
        if field.startswith("cmd.") and field not in commands:
            raise LogError(path, f"not a command term of task {task.name!r} (its commands: "
                                 f"{', '.join(commands) or 'none'})", column=field)
    for field in commands:
        if field not in cols:
            raise LogError(path, f"missing: task {task.name!r} observes {field[4:]!r} as a command (the bundle's "
                                 f"I/O contract must mark it source: command)", column=field)


def telemetry_field(column: str, task: Task) -> str:
    """The telemetry field a converted log column came from (``qvel.0`` → ``state.<nq>``, ``ctrl.1`` → ``act.<name>``)."""
    prefix, _, index = column.partition(".")
    if prefix == "qpos":
        return f"state.{index}"
    if prefix == "qvel":
        return f"state.{task.model.nq + int(index)}"
    if prefix == "ctrl":
        return f"act.{task.actions[int(index)].name}"
    return column


def relabel(error: LogError, path: Path, task: Task) -> LogError:
    """``error`` about a converted file, told about the telemetry file ``path`` and its field."""
    return LogError(path, error.detail, error.episode, error.column and telemetry_field(error.column, task), error.row)
