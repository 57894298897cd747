"""The device store: verified bundles, the ``current``/``previous`` links, and the journal.

    <root>/bundles/<policy>/<version>/   verified, read-only, never modified
    <root>/current -> bundles/…          switched by an atomic rename
    <root>/previous -> bundles/…
    <root>/journal.jsonl                 every pull, install, activation, rollback
    <root>/tmp/                          staging, on the same filesystem
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Optional


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DeviceStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def journal_path(self) -> Path:
        return self.root / "journal.jsonl"

    def bundle_dir(self, policy: str, version: str) -> Path:
        return self.root / "bundles" / policy / version

    def staging_dir(self) -> Path:
        """A fresh temporary directory on the store's filesystem."""
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=str(self.root / "tmp")))

    def link(self, name: str) -> Optional[Path]:
        """Where ``current`` or ``previous`` points, or None."""
        path = self.root / name
        return (self.root / os.readlink(str(path))) if path.is_symlink() else None

    def install(self, staged: Path, policy: str, version: str) -> Path:
        """Move a verified staging directory into place, read-only; return its final path."""
        final = self.bundle_dir(policy, version)
        if final.exists():
            shutil.rmtree(staged)
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        for f in staged.rglob("*"):
            f.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXUSR if f.is_dir() else 0))
        os.replace(str(staged), str(final))
        _fsync_dir(final.parent)
        return final

    def activate(self, bundle: Path) -> None:
        """Point ``current`` at ``bundle`` (and ``previous`` at the old current) by atomic renames."""
        old = self.link("current")
        if old is not None and old != bundle:
            self._switch("previous", old)
        self._switch("current", bundle)

    def _switch(self, name: str, target: Path) -> None:
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(os.path.relpath(str(target), str(self.root)), str(tmp))
        os.replace(str(tmp), str(self.root / name))
        _fsync_dir(self.root)

    def record(self, event: str, **fields: object) -> None:
        """Append one event to the journal (fsynced)."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps(dict(time=time.time(), event=event, **fields), sort_keys=True)
        with open(self.journal_path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def history(self) -> list:
        if not self.journal_path.exists():
            return []
        return [json.loads(line) for line in self.journal_path.read_text().splitlines() if line.strip()]

    def installed(self, policy: str) -> list:
        """Installed versions of ``policy``, oldest first."""
        base = self.root / "bundles" / policy
        return sorted((p.name for p in base.iterdir() if p.is_dir()), key=int) if base.is_dir() else []

    def gc(self, keep: int) -> list:
        """Delete all but the newest ``keep`` versions of each policy, never ``current`` or ``previous``."""
        pinned = {self.link("current"), self.link("previous")}
        removed = []
        for policy_dir in sorted((self.root / "bundles").glob("*")):
            versions = self.installed(policy_dir.name)
            for version in versions[: max(0, len(versions) - keep)]:
                path = policy_dir / version
                if path in pinned:
                    continue
                for f in [path, *path.rglob("*")]:
                    f.chmod(0o700 if f.is_dir() else 0o600)
                shutil.rmtree(path)
                removed.append(f"{policy_dir.name}/{version}")
        if removed:
            self.record("gc", removed=removed, keep=keep)
        return removed

    def current_manifest(self) -> Optional[dict]:
        current = self.link("current")
        return json.loads((current / "manifest.json").read_text()) if current else None
