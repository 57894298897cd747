"""The one robot log format (Parquet), shared by device telemetry, demonstrations and sim rollouts.

One row per control step, rows grouped by episode in step order. Columns:

- ``episode`` (int), ``step`` (int, consecutive from the episode's first row), ``time`` (s, increasing);
- ``obs.<name>`` for each of the task's observation terms, ``act.<name>`` for each action term
  (normalized policy output in [-1, 1]);
- ``ctrl.<i>``: the actuator controls the controller *commanded* at this step (any actuation
  latency of the robot is what calibration fits), ``qpos.<i>``, ``qvel.<i>``: measured joint state;
- ``inference_ms``, ``loop_ms``: policy inference time and control-loop period;
- ``policy_version`` (who acted: a model version, ``excitation`` or ``demonstration``), ``device_id``.

The schema version is stored in the Parquet metadata and in the dataset manifest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1
SCHEMA_KEY = b"sim2edge.schema_version"
STRING_COLUMNS = ("policy_version", "device_id")


def expected_columns(obs_names: list[str], act_names: list[str], nu: int, nq: int, nv: int) -> list[str]:
    """Every column a log of a task with these terms and sizes must have, in order."""
    return (["episode", "step", "time"] + [f"obs.{n}" for n in obs_names] + [f"act.{n}" for n in act_names]
            + [f"ctrl.{i}" for i in range(nu)] + [f"qpos.{i}" for i in range(nq)] + [f"qvel.{i}" for i in range(nv)]
            + ["inference_ms", "loop_ms", *STRING_COLUMNS])


def episode_table(
    episode: int, dt: float, obs_names: list[str], act_names: list[str],
    obs: np.ndarray, act: np.ndarray, ctrl: np.ndarray, qpos: np.ndarray, qvel: np.ndarray,
    inference_ms: np.ndarray, policy_version: str, device_id: str,
) -> pa.Table:
    """One episode's rows (T steps) as an Arrow table."""
    steps = len(obs)
    cols: dict[str, object] = {
        "episode": np.full(steps, episode, dtype=np.int64),
        "step": np.arange(steps, dtype=np.int64),
        "time": np.arange(steps) * dt,
    }
    cols.update({f"obs.{n}": obs[:, i].astype(np.float32) for i, n in enumerate(obs_names)})
    cols.update({f"act.{n}": act[:, i].astype(np.float32) for i, n in enumerate(act_names)})
    for prefix, arr in (("ctrl", ctrl), ("qpos", qpos), ("qvel", qvel)):
        cols.update({f"{prefix}.{i}": arr[:, i].astype(np.float64) for i in range(arr.shape[1])})  # one schema for every source
    cols["inference_ms"] = np.asarray(inference_ms, dtype=np.float32)
    cols["loop_ms"] = np.full(steps, dt * 1e3, dtype=np.float32)
    cols["policy_version"] = [policy_version] * steps
    cols["device_id"] = [device_id] * steps
    return pa.table(cols)


def write(table: pa.Table, path: Path) -> None:
    """Write ``table`` with the schema version in its metadata (to a temporary name, then renamed)."""
    meta = {**(table.schema.metadata or {}), SCHEMA_KEY: str(SCHEMA_VERSION).encode()}
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table.replace_schema_metadata(meta), tmp)
    tmp.replace(path)


def read(path: Path) -> pa.Table:
    """Read a log file; refuse unknown schema versions."""
    table = pq.read_table(path)
    version = (table.schema.metadata or {}).get(SCHEMA_KEY)
    if version is None or version != str(SCHEMA_VERSION).encode():
        raise ValueError(f"{path}: schema version {version!r} is not {SCHEMA_VERSION}")
    return table


def columns(table: pa.Table, prefix: str) -> np.ndarray:
    """All ``prefix.*`` columns stacked as (rows, k), in column order."""
    names = [c for c in table.column_names if c.startswith(prefix + ".")]
    return np.stack([table.column(c).to_numpy() for c in names], axis=1)
