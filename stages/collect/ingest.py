"""Ingest from a folder (what devices upload, demonstrations) or from stand-in rollouts."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from stages import standin
from stages.collect import bag_logs, device_logs, lerobot_logs
from stages.collect.bag_mapping import BagMapping
from stages.collect.lerobot_logs import LeRobotMapping
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore, IngestReport


class StandinConfig(BaseModel):
    """How much reference-robot (stand-in) data to record, and with which excitation."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    episodes: int = Field(16, ge=1, description="Episodes to record (each the task's episode length).")
    seed: int = Field(0, description="Seed of the excitation and the stand-in's noise.")
    smoothing: float = Field(0.8, ge=0, lt=1, description="AR(1) coefficient of the random excitation.")
    amplitude: float | None = Field(None, gt=0, description="Std of the excitation before its ±1 clip, in normalized "
                                    "action units; None: the task's ``excitation_scale``.")


def new_files(folder: Path, since_ns: int) -> tuple[list[Path], int]:
    """Logs (``*.parquet``, the agent's ``*.npz`` and ``*.mcap``) under ``folder`` modified at or after ``since_ns``,
    and the newest mtime seen."""
    if not folder.is_dir():
        raise FileNotFoundError(f"log folder {folder} does not exist")
    found = [(p, p.stat().st_mtime_ns) for suffix in (".parquet", *device_logs.TELEMETRY_SUFFIXES)
             for p in folder.rglob(f"*{suffix}")
             if not p.name.startswith(".")]
    fresh = [p for p, m in found if m >= since_ns]
    return fresh, max([since_ns] + [m for _, m in found])


def ingest_folder(store: DatasetStore, folder: Path) -> IngestReport:
    """Ingest what is new in ``folder`` since its watermark (file mtime); same digests are skipped."""
    source = f"folder:{folder.resolve()}"
    paths, newest = new_files(folder, store.watermark(source))
    return store.ingest(paths, source, watermark=newest)


def ingest_bag(store: DatasetStore, bag: Path, mapping: BagMapping) -> IngestReport:
    """Ingest a rosbag2 bag (directory, or one .mcap/.db3 file): what was received since its watermark (the end
    of the bag when last ingested); stale episodes are quarantined with the reason."""
    source = f"rosbag:{bag.resolve()}"
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.root) as work:
        converted = bag_logs.convert(bag, mapping, store.task, Path(work), store.watermark(source))
        report = store.ingest([converted.log] if converted.log else [], source, watermark=converted.end_ns,
                              refused=converted.refused)
    return report.model_copy(update={  # name the bag, not the converted files (gone with the work folder)
        "added": (str(bag),) if report.added else (), "duplicates": (str(bag),) if report.duplicates else (),
        "quarantined": tuple(q.model_copy(update={"file": str(bag)}) for q in report.quarantined)})


def ingest_lerobot(store: DatasetStore, root: Path, mapping: LeRobotMapping) -> IngestReport:
    """Ingest a LeRobot v3 dataset folder, one log file per episode (a bad episode is quarantined alone); episodes
    ingested before (same content) are skipped. The report names ``<root>/<episode file>``."""
    store.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store.root) as work:
        report = store.ingest(lerobot_logs.to_logs(root, mapping, store.task, Path(work)), f"lerobot:{root.resolve()}")

    def named(text: str) -> str:  # the converted files are gone with ``work``
        return text.replace(work, str(root))

    return report.model_copy(update={
        "added": tuple(map(named, report.added)), "duplicates": tuple(map(named, report.duplicates)),
        "quarantined": tuple(q.model_copy(update={"file": named(q.file), "reason": named(q.reason)})
                             for q in report.quarantined)})


def record_standin(store: DatasetStore, cfg: StandinConfig, incoming: Path) -> IngestReport:
    """Record stand-in episodes into ``incoming`` (as a device would upload them), then ingest that folder."""
    task = store.task
    robot = standin.robot_id(task.name)
    record(task, standin.hidden_params(task.name), cfg.episodes, cfg.seed,
           incoming / f"{robot.replace(':', '-')}-seed{cfg.seed}-{cfg.episodes}ep.parquet", robot, cfg.smoothing,
           amplitude=cfg.amplitude)
    return ingest_folder(store, incoming)
