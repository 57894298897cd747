"""The dataset store: content-addressed log files, immutable dataset versions, watermarks, quarantine.

```
<root>/files/<sha256>.parquet        validated log files, by content (agent .npz/.mcap telemetry converted first)
<root>/versions/v0001/manifest.json  one dataset version: every file it holds, with digests
<root>/latest                        the newest version's name, replaced atomically last
<root>/watermarks.json               per source: how far ingest has read
<root>/quarantine/<sha256>-<name>    refused files, each with <…>.reason.json
```
A version is the previous version plus what was new; a file already in it (same digest)
is skipped. Nothing is visible in ``latest`` before its version directory is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from edge.bundle import sha256_path
from stages import logs
from stages.artifacts import Dataset, atomic_dir, sha256_json
from stages.collect import device_logs
from stages.collect.validate import LogError, validate
from stages.sim.task import Task


class Quarantined(BaseModel):
    model_config = ConfigDict(frozen=True)
    file: str
    sha256: str
    reason: str


class IngestReport(BaseModel):
    """What one ingest did. ``dataset`` is the newest version afterwards (None if the store is empty)."""

    model_config = ConfigDict(frozen=True)
    dataset: Dataset | None
    new_version: bool
    added: tuple[str, ...]
    duplicates: tuple[str, ...]
    quarantined: tuple[Quarantined, ...]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dataset_files(dataset: Dataset) -> list[Path]:
    """The log files of a dataset version, in manifest order."""
    manifest = json.loads((dataset.path / "manifest.json").read_text())
    return [(dataset.path / f["path"]).resolve() for f in manifest["files"]]


class DatasetStore:
    """All dataset versions of one task under ``root``."""

    def __init__(self, root: Path, task: Task, task_ref: str) -> None:
        self.root, self.task, self.task_ref = root, task, task_ref

    @property
    def latest_file(self) -> Path:
        return self.root / "latest"

    @property
    def watermarks_file(self) -> Path:
        return self.root / "watermarks.json"

    def latest(self) -> Dataset | None:
        if not self.latest_file.exists():
            return None
        return self.version(self.latest_file.read_text().strip())

    def version(self, name: str) -> Dataset:
        path = self.root / "versions" / name
        if not (path / "manifest.json").exists():
            known = sorted(p.name for p in (self.root / "versions").glob("v*")) if (self.root / "versions").exists() else []
            raise KeyError(f"no dataset version {name!r} in {self.root}; versions: {', '.join(known) or 'none'}")
        m = json.loads((path / "manifest.json").read_text())
        return Dataset(path=path, digest=m["digest"], task=m["task"], source=", ".join(m["sources"]),
                       episodes=m["episodes"], rows=m["rows"], version=m["version"])

    def watermark(self, source: str) -> int:
        marks = json.loads(self.watermarks_file.read_text()) if self.watermarks_file.exists() else {}
        return int(marks.get(source, 0))

    def _set_watermark(self, source: str, value: int) -> None:
        marks = json.loads(self.watermarks_file.read_text()) if self.watermarks_file.exists() else {}
        marks[source] = max(value, int(marks.get(source, 0)))
        _write_atomic(self.watermarks_file, json.dumps(marks, indent=2, sort_keys=True))

    def _quarantine(self, path: Path, digest: str, error: LogError) -> Quarantined:
        qdir = self.root / "quarantine"
        qdir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, qdir / f"{digest[:16]}-{path.name}")
        entry = Quarantined(file=str(path), sha256=digest, reason=str(error))
        _write_atomic(qdir / f"{digest[:16]}-{path.name}.reason.json", entry.model_dump_json(indent=2))
        return entry

    def ingest(self, paths: list[Path], source: str, watermark: int | None = None,
               refused: Sequence[tuple[Path, LogError]] = ()) -> IngestReport:
        """Validate and add ``paths`` as a new version; bad files go to quarantine, the rest still ingest.

        ``refused`` are files a converter already found bad (with why): they go to quarantine too.

        ``watermark`` (e.g. the newest mtime or run time read from ``source``) is stored only
        after the new version is committed, so an interrupted ingest re-reads next time.
        """
        previous = self.latest()
        old = json.loads((previous.path / "manifest.json").read_text())["files"] if previous else []
        known = {f["sha256"] for f in old} | {f["telemetry_sha256"] for f in old if "telemetry_sha256" in f}
        added, duplicates, entries = [], [], []
        quarantined = [self._quarantine(path, sha256_path(path), error) for path, error in refused]
        files_dir = self.root / "files"
        files_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root) as work:
            for path in sorted(paths):
                original = sha256_path(path)
                if original in known:
                    duplicates.append(str(path))
                    continue
                log = path
                try:
                    if path.suffix in device_logs.TELEMETRY_SUFFIXES:
                        try:
                            log = device_logs.convert(path, self.task, Path(work) / f"{original}.parquet")
                            summary = validate(log, self.task)
                        except LogError as e:
                            raise device_logs.relabel(e, path, self.task) from None
                    else:
                        summary = validate(path, self.task)
                except LogError as e:
                    quarantined.append(self._quarantine(path, original, e))
                    continue
                digest = original if log == path else sha256_path(log)
                known |= {original, digest}
                stored = files_dir / f"{digest}.parquet"
                if not stored.exists():
                    tmp = files_dir / f".{digest}.tmp"
                    shutil.copyfile(log, tmp)
                    os.replace(tmp, stored)
                added.append(str(path))
                entries.append({"name": path.name, "sha256": digest, "path": f"../../files/{digest}.parquet",
                                "source": source, "rows": summary.rows, "episodes": summary.episodes,
                                "time_range_s": list(summary.time_range_s), "device_ids": list(summary.device_ids),
                                "policy_versions": list(summary.policy_versions),
                                **({"telemetry_sha256": original} if log != path else {})})
        dataset = previous
        if entries:
            dataset = self._commit(previous, old + entries)
        if watermark is not None:
            self._set_watermark(source, watermark)
        return IngestReport(dataset=dataset, new_version=bool(entries), added=tuple(added),
                            duplicates=tuple(duplicates), quarantined=tuple(quarantined))

    def _commit(self, previous: Dataset | None, files: list[dict]) -> Dataset:
        number = (previous.version if previous else 0) + 1
        name = f"v{number:04d}"
        manifest = {
            "schema_version": logs.SCHEMA_VERSION,
            "task": self.task_ref,
            "version": number,
            "parent": previous.digest if previous else None,
            "digest": sha256_json(sorted(f["sha256"] for f in files)),
            "created_unix": int(time.time()),
            "robots": sorted({d for f in files for d in f["device_ids"]}),
            "sources": sorted({f["source"] for f in files}),
            "episodes": sum(f["episodes"] for f in files),
            "rows": sum(f["rows"] for f in files),
            "time_range_s": [min(f["time_range_s"][0] for f in files), max(f["time_range_s"][1] for f in files)],
            "files": files,
        }
        with atomic_dir(self.root / "versions" / name) as tmp:
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _write_atomic(self.latest_file, name + "\n")
        return self.version(name)
