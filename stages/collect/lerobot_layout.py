"""The LeRobot v3.0 dataset layout, read and written with pyarrow alone (LeRobot itself is not a dependency).

```
meta/info.json                                codebase_version, fps, features {dtype, shape, names}, totals, paths
meta/tasks.parquet                            index ``task`` (the text), column ``task_index``
meta/episodes/chunk-000/file-000.parquet      one row per episode: index, tasks, length, where its frames are,
                                              per-feature stats (``stats/<feature>/<min|max|mean|std|count>``)
meta/stats.json                               the same stats over the whole dataset
data/chunk-000/file-000.parquet               one row per frame; a vector feature is a fixed_size_list column
                                              (a feature of shape (1,) a plain column, as LeRobot reads it)
```
Only numeric features are handled here (no images or videos): what robot logs hold. Written so that LeRobot's
``LeRobotDataset(repo_id, root=...)`` loads it (its loader reads the data files with the features of
``info.json`` as Hugging Face ``datasets`` features, the same types this module writes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
FRAME_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")


@dataclass(frozen=True)
class Feature:
    """One per-frame feature: a vector of ``len(names)`` values of ``dtype`` (float32 or float64)."""

    name: str
    dtype: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class LeRobotEpisodes:
    """A dataset's frames: each feature as (frames, width), the episode of each frame, and the frame rate."""

    fps: float
    features: dict[str, Feature]
    values: dict[str, np.ndarray]
    episode_index: np.ndarray
    timestamp: np.ndarray
    robot_type: str | None = None


class LeRobotFormatError(ValueError):
    """A dataset folder that is not a readable LeRobot v3 dataset: names the file and what is wrong."""


def _info_feature(feature: Feature) -> dict:
    return {"dtype": feature.dtype, "shape": [len(feature.names)], "names": list(feature.names)}


def _stats(values: np.ndarray) -> dict[str, list]:
    v = values.astype(np.float64)
    return {"min": v.min(0).tolist(), "max": v.max(0).tolist(), "mean": v.mean(0).tolist(),
            "std": v.std(0).tolist(), "count": [len(v)]}


def write(root: Path, data: LeRobotEpisodes, task_text: str) -> None:
    """Write ``data`` as a LeRobot v3.0 dataset under ``root`` (which must not hold one): one task, one data file."""
    if (root / "meta" / "info.json").exists():
        raise FileExistsError(f"{root}: already holds a LeRobot dataset (meta/info.json)")
    frames, episodes = len(data.episode_index), np.unique(data.episode_index)
    if not np.all(np.diff(data.episode_index) >= 0):
        raise ValueError("frames must be grouped by episode in order")
    frame_index = np.concatenate([np.arange((data.episode_index == e).sum()) for e in episodes]) if frames else []
    columns: dict[str, pa.Array] = {}
    for name, feature in data.features.items():
        flat = pa.array(data.values[name].astype(feature.dtype).ravel())
        # LeRobot reads a feature of shape (1,) as a plain value, wider ones as fixed-size lists
        columns[name] = flat if len(feature.names) == 1 else pa.FixedSizeListArray.from_arrays(flat, len(feature.names))
    columns.update({"timestamp": pa.array(data.timestamp, pa.float32()),
                    "frame_index": pa.array(frame_index, pa.int64()),
                    "episode_index": pa.array(data.episode_index, pa.int64()),
                    "index": pa.array(np.arange(frames), pa.int64()),
                    "task_index": pa.array(np.zeros(frames, np.int64))})
    (root / "data" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table(columns), root / DATA_PATH.format(chunk_index=0, file_index=0))

    rows = []
    for e in episodes:
        at = np.flatnonzero(data.episode_index == e)
        row = {"episode_index": int(e), "tasks": [task_text], "length": len(at),
               "data/chunk_index": 0, "data/file_index": 0,
               "dataset_from_index": int(at[0]), "dataset_to_index": int(at[-1]) + 1,
               "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
        for name in data.features:
            row.update({f"stats/{name}/{k}": v for k, v in _stats(data.values[name][at]).items()})
        rows.append(row)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / EPISODES_PATH.format(chunk_index=0, file_index=0))
    pd.DataFrame({"task_index": [0]}, index=pd.Index([task_text], name="task")).to_parquet(root / "meta" / "tasks.parquet")
    stats = {name: _stats(data.values[name]) for name in data.features}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=2))
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": data.robot_type, "total_episodes": len(episodes),
            "total_frames": frames, "total_tasks": 1, "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 500, "fps": data.fps, "splits": {"train": f"0:{len(episodes)}"},
            "data_path": DATA_PATH, "video_path": None,
            "features": {**{n: _info_feature(f) for n, f in data.features.items()},
                         "timestamp": {"dtype": "float32", "shape": [1], "names": None},
                         **{n: {"dtype": "int64", "shape": [1], "names": None} for n in FRAME_FEATURES[1:]}}}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))


def element_names(root: Path, name: str, spec: dict) -> tuple[str, ...]:
    """The element names of a vector feature: ``names`` as a list, or a dict holding one list (older datasets)."""
    names = spec.get("names")
    if isinstance(names, dict) and len(names) == 1:
        names = next(iter(names.values()))
    width = int(np.prod(spec.get("shape") or [0]))
    if not isinstance(names, list) or len(names) != width or not all(isinstance(n, str) for n in names):
        raise LeRobotFormatError(f"{root}/meta/info.json: features.{name}.names must list the {width} element "
                                 f"names (got {spec.get('names')!r})")
    return tuple(names)


def read(root: Path, wanted: list[str]) -> LeRobotEpisodes:
    """The ``wanted`` vector features of the dataset under ``root``, every frame, in episode order."""
    info_path = root / "meta" / "info.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LeRobotFormatError(f"{info_path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3."):
        raise LeRobotFormatError(f"{info_path}: codebase_version {version!r} is not v3.x (convert it with LeRobot's "
                                 f"v2.1 → v3.0 script)")
    fps = info.get("fps")
    if not isinstance(fps, (int, float)) or not fps > 0:
        raise LeRobotFormatError(f"{info_path}: fps {fps!r} is not a positive number")
    known = info.get("features") or {}
    features = {}
    for name in wanted:
        if name not in known:
            raise LeRobotFormatError(f"{info_path}: no feature {name!r} (it has {', '.join(sorted(known))})")
        dtype = known[name].get("dtype")
        if dtype not in ("float32", "float64"):
            raise LeRobotFormatError(f"{info_path}: features.{name}.dtype {dtype!r} is not float32 or float64")
        features[name] = Feature(name, dtype, element_names(root, name, known[name]))
    files = sorted((root / "data").glob("chunk-*/file-*.parquet"))
    if not files:
        raise LeRobotFormatError(f"{root}/data: no chunk-*/file-*.parquet data files")
    tables = []
    for path in files:
        try:
            table = pq.read_table(path, columns=[*wanted, "episode_index", "timestamp", "index"])
        except (OSError, pa.ArrowInvalid, KeyError) as e:
            raise LeRobotFormatError(f"{path}: {str(e).splitlines()[0]}") from None
        tables.append(table)
    table = pa.concat_tables(tables).sort_by([("index", "ascending")])
    values = {}
    for name, feature in features.items():
        column = table.column(name).combine_chunks()
        nested = pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type)
        flat = (column.flatten() if nested else column).to_numpy(zero_copy_only=False) if len(column) else np.zeros(0)
        if len(flat) != len(column) * len(feature.names):
            raise LeRobotFormatError(f"{root}/data: feature {name!r} rows are not all {len(feature.names)} wide")
        values[name] = flat.reshape(len(column), len(feature.names)).astype(np.float64)
    episode = table.column("episode_index").to_numpy()
    order = np.argsort(episode, kind="stable")  # frames grouped by episode, in frame order within each
    return LeRobotEpisodes(fps=float(fps), features=features, values={n: v[order] for n, v in values.items()},
                           episode_index=episode[order], timestamp=table.column("timestamp").to_numpy()[order],
                           robot_type=info.get("robot_type"))
