"""The one robot log format (Parquet), shared by device telemetry, demonstrations and sim rollouts.

One row per control step. Columns: ``episode``, ``step``, ``time`` (s), ``obs.<name>``,
``act.<name>`` (normalized policy output), ``ctrl.<i>`` (applied controls), ``qpos.<i>``,
``qvel.<i>`` (measured), ``policy_version``, ``device_id``. The schema version is stored
in the Parquet metadata and in the dataset manifest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = 1


def episode_table(
    episode: int, dt: float, obs_names: list[str], act_names: list[str],
    obs: np.ndarray, act: np.ndarray, ctrl: np.ndarray, qpos: np.ndarray, qvel: np.ndarray,
    policy_version: str, device_id: str,
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
        cols.update({f"{prefix}.{i}": arr[:, i] for i in range(arr.shape[1])})
    cols["policy_version"] = [policy_version] * steps
    cols["device_id"] = [device_id] * steps
    return pa.table(cols)


def write(table: pa.Table, path: Path) -> None:
    """Write ``table`` with the schema version in its metadata."""
    meta = {**(table.schema.metadata or {}), b"sim2edge.schema_version": str(SCHEMA_VERSION).encode()}
    pq.write_table(table.replace_schema_metadata(meta), path)


def read(path: Path) -> pa.Table:
    """Read a log file; refuse unknown schema versions."""
    table = pq.read_table(path)
    version = (table.schema.metadata or {}).get(b"sim2edge.schema_version")
    if version is None or int(version) != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema version {version!r} is not {SCHEMA_VERSION}")
    return table


def columns(table: pa.Table, prefix: str) -> np.ndarray:
    """All ``prefix.*`` columns stacked as (rows, k), in column order."""
    names = [c for c in table.column_names if c.startswith(prefix + ".")]
    return np.stack([table.column(c).to_numpy() for c in names], axis=1)
