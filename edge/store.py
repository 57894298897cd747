"""The device store: verified bundles, the ``current``/``previous`` links, and the journal.

    <root>/bundles/<policy>/<version>/   verified, read-only, never modified
    <root>/current -> bundles/…          switched by an atomic rename
    <root>/previous -> bundles/…
    <root>/journal.jsonl                 every pull, install, activation, rollback
    <root>/tmp/                          staging, on the same filesystem
    <root>/downloads/<sha256>.part       a download in progress (resumed by the next pull)
    <root>/backoff.json                  registry failures and when the next attempt may start
    <root>/failed.json                   versions whose bundle failed a check, by digest (not retried)
    <root>/lock                          held (flock) by the one agent that may change the store

Crash safety: a bundle directory appears by one rename of a complete, fsynced staging
directory; links switch by rename over the old link; the journal tolerates a torn last line.
Whatever a killed agent leaves in ``tmp/`` or as ``.*.tmp`` links is removed by the next one.

Links: the store follows no symbolic link it did not make. ``current``, ``previous`` and their
``.*.tmp`` forerunners are the only links it makes, and it only reads them (``readlink``) or
replaces them. Every other path below the root (the lock, the journal, ``tmp/``, ``downloads/``,
``bundles/<policy>/<version>``) is checked component by component with ``lstat`` before it is
opened, renamed or deleted, and files are opened with ``O_NOFOLLOW``: a link there is refused
(check ``store``) naming it, and nothing it points at is touched. The root itself may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional

from edge import crash
from edge.errors import CheckFailed
from edge.values import VERSION, PolicyName, Sha256, Version


def no_link(path: Path) -> Path:
    """``path``, refused (check ``store``) if it is a symbolic link."""
    if path.is_symlink():
        raise CheckFailed("store", f"{path} is a symbolic link; the store follows no link it did not make")
    return path


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses (check ``store``) a symbolic link at ``path`` instead of following it."""
    try:
        return os.open(str(path), flags | os.O_NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckFailed("store", f"{path} is a symbolic link; the store follows no link it did not make") from None
        raise


def seconds_left(last: float, next_: float, cap_s: float, now: float) -> float:
    """Seconds until an attempt planned for ``next_`` after one at ``last``, robust to the wall clock jumping:
    a recorded time in the future counts as ``now``, and the wait is never longer than ``cap_s``."""
    delay = min(max(next_ - last, 0.0), cap_s)
    return max(0.0, min(last, now) + delay - now)


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_writable(path: Path) -> None:
    for f in [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else []:
        if not f.is_symlink():
            f.chmod(0o700 if f.is_dir() else 0o600)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` by a rename of a fsynced temporary file (a link at ``path`` is replaced,
    never followed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    if tmp.is_symlink():
        tmp.unlink()
    with os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(str(tmp), str(path))
    fsync_dir(path.parent)


class DeviceStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.engines_dir = self.root / "engines"
        """TensorRT engines built on this device, keyed by TensorRT version, GPU, precision and ONNX digest."""

    @property
    def journal_path(self) -> Path:
        return self.root / "journal.jsonl"

    def inside(self, *parts: str) -> Path:
        """``<root>/<parts…>``, refused (check ``store``) unless it resolves to a path inside the store root.

        Every path the store builds from a value (policy, version, digest) goes through here, after the
        value itself was parsed (edge/values.py): two independent guards against leaving the store."""
        path = self.root.joinpath(*parts)
        for depth in range(1, len(parts) + 1):
            no_link(self.root.joinpath(*parts[:depth]))
        root, resolved = self.root.resolve(), path.resolve()
        if resolved != root and root not in resolved.parents:
            raise CheckFailed("store", f"{path} resolves to {resolved}, outside the store {root}")
        return path

    def bundle_dir(self, policy: str, version: str) -> Path:
        return self.inside("bundles", PolicyName.parse(policy, check="store"), Version.parse(version, check="store"))

    def staging_dir(self) -> Path:
        """A fresh temporary directory on the store's filesystem."""
        tmp = self.inside("tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=str(no_link(tmp))))

    def discard(self, staged: Path) -> None:
        """Remove a staging directory and whatever is in it (read-only files included)."""
        if staged.is_symlink():
            staged.unlink()
            return
        make_writable(staged)
        shutil.rmtree(str(staged), ignore_errors=True)

    def download_part(self, sha256: str) -> Path:
        """Where the download of the bundle with digest ``sha256`` accumulates (kept across runs)."""
        self.inside("downloads").mkdir(parents=True, exist_ok=True)
        return self.inside("downloads", f"{Sha256.parse(sha256, check='store')}.part")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock; a second agent is refused rather than interleaved. Dies with the process."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_nofollow(self.root / "lock", os.O_RDWR | os.O_CREAT)
        except CheckFailed as e:
            self._journal_link(e)
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise CheckFailed("lock", f"another sim2edge-agent (pid {holder}) holds {self.root / 'lock'}") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            try:
                self._clean_leftovers()
                yield
            except CheckFailed as e:
                self._journal_link(e)
                raise
        finally:
            os.close(fd)

    def _journal_link(self, e: CheckFailed) -> None:
        """Journal a ``store`` refusal (a link planted in the store), unless the journal is the link."""
        if e.check == "store":
            with contextlib.suppress(CheckFailed, OSError):
                self.record("refused", check=e.check, detail=e.detail)

    def _clean_leftovers(self) -> None:
        """Remove what a killed agent left behind: staging directories and half-made links (lock held)."""
        tmp = self.inside("tmp")
        if tmp.is_dir():
            for leftover in tmp.iterdir():
                self.discard(leftover)
        for link in self.root.glob(".*.tmp"):
            if link.is_symlink():
                link.unlink()
        for part in self.root.glob(".*.part"):
            part.unlink()
        self._journal_unjournaled_switch()

    def _journal_unjournaled_switch(self) -> None:
        """If an agent died between switching ``current`` and journaling it, say so in the journal."""
        current = self.link("current")
        if current is None:
            return
        switches = [e for e in self.history() if e["event"] in ("activate", "rollback", "recovered")]
        last = (switches[-1].get("policy"), str(switches[-1].get("version"))) if switches else None
        if last != (current.parent.name, current.name):
            self.record("recovered", policy=current.parent.name, version=current.name,
                        detail="current was switched by an agent that stopped before journaling it")

    # -- backoff between attempts when the registry is unavailable, persisted so separate runs share it
    @property
    def backoff_path(self) -> Path:
        return self.root / "backoff.json"

    def backoff_state(self) -> Optional[dict]:
        try:
            return json.loads(self.backoff_path.read_text())
        except (OSError, ValueError):
            return None

    def note_unavailable(self, registry: str, detail: str, base_s: float, cap_s: float) -> dict:
        """Count one more failed attempt on ``registry``; the next may start after base·2^(n-1), jittered."""
        old = self.backoff_state()
        failures = (old.get("failures", 0) if old and old.get("registry") == registry else 0) + 1
        delay = min(cap_s, base_s * 2 ** (failures - 1))
        delay = random.uniform(delay / 2, delay)  # equal jitter: devices that failed together retry apart
        state = {"registry": registry, "failures": failures, "last_error": detail,
                 "last_attempt": time.time(), "next_attempt": time.time() + delay}
        write_atomic(self.backoff_path, json.dumps(state, sort_keys=True).encode())
        return state

    def backoff_left(self, registry: str, cap_s: float) -> Optional[tuple]:
        """(seconds left, state) while pulls from ``registry`` back off (see :func:`seconds_left`), else None."""
        state = self.backoff_state()
        if not isinstance(state, dict) or not state.get("failures") or state.get("registry") != registry:
            return None
        try:
            last, next_ = float(state["last_attempt"]), float(state["next_attempt"])
        except (KeyError, TypeError, ValueError):
            return None
        now = time.time()
        left = seconds_left(last, next_, cap_s, now)
        if last > now:  # recorded under a clock that ran ahead: from now on, count from now
            state = dict(state, last_attempt=now, next_attempt=now + left)
            write_atomic(self.backoff_path, json.dumps(state, sort_keys=True).encode())
        return (left, state) if left > 0 else None

    def clear_backoff(self) -> None:
        """After a successful exchange with the registry: no failures. The file stays (the store's set of
        files does not change with the registry's availability)."""
        state = self.backoff_state()
        if state is None or state.get("failures"):
            write_atomic(self.backoff_path, json.dumps({"failures": 0}).encode())

    # -- versions whose bundle failed verification, the smoke test or the health check: not downloaded again
    @property
    def failed_path(self) -> Path:
        return self.root / "failed.json"

    def failed_versions(self) -> dict:
        """``{"<policy>/<version>": {policy, version, bundle_sha256, check, detail, time, count}}``."""
        try:
            return json.loads(self.failed_path.read_text())
        except (OSError, ValueError):
            return {}

    def known_bad(self, policy: str, version: str, sha256: str, keys: List[str]) -> Optional[dict]:
        """The failure recorded for this version, if its bundle had this same digest; a signature failure
        counts only against the same set of trusted keys (``keys``: their ids), so a changed ``--trust`` retries."""
        entry = self.failed_versions().get(f"{policy}/{version}")
        if not entry or entry.get("bundle_sha256") != sha256:
            return None
        return None if entry.get("check") == "signature" and entry.get("trusted_keys") != keys else entry

    def note_failed(self, policy: str, version: str, sha256: str, check: str, detail: str, keys: List[str]) -> dict:
        """Remember that this version's bundle (by digest) failed ``check`` with these trusted keys; counts repeats."""
        failed = self.failed_versions()
        old = self.known_bad(policy, version, sha256, keys)
        entry = {"policy": policy, "version": version, "bundle_sha256": sha256, "check": check,
                 "detail": detail[:500], "time": time.time(), "count": (old["count"] if old else 0) + 1,
                 "trusted_keys": keys}
        failed[f"{policy}/{version}"] = entry
        write_atomic(self.failed_path, json.dumps(failed, sort_keys=True).encode())
        return entry

    def clear_failed(self, policy: str, version: str) -> None:
        """Forget a failure (the version was activated after all)."""
        failed = self.failed_versions()
        if failed.pop(f"{policy}/{version}", None) is not None:
            write_atomic(self.failed_path, json.dumps(failed, sort_keys=True).encode())

    def disk_full(self, e: OSError, doing: str) -> CheckFailed:
        """The refusal (check ``disk``) for ``e``, a full disk while ``doing``, naming the store and its free space."""
        try:
            free = f"{self.free_bytes()} bytes free"
        except OSError:
            free = "free space unknown"
        where = f" ({e.filename})" if e.filename else ""
        return CheckFailed("disk", f"no space left on the store's filesystem {self.root} while {doing}{where}: "
                                   f"{free}; nothing was kept")

    def free_bytes(self) -> int:
        st = os.statvfs(str(self.root))
        return st.f_bavail * st.f_frsize

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
        for d in [*(d for d in staged.rglob("*") if d.is_dir()), staged]:  # every directory a file was made in
            fsync_dir(d)
        crash.point("install-chmod")
        os.replace(str(staged), str(final))
        fsync_dir(final.parent)
        crash.point("installed")
        return final

    def activate(self, bundle: Path) -> None:
        """Point ``current`` at ``bundle`` (and ``previous`` at the old current) by atomic renames."""
        old = self.link("current")
        if old is not None and old != bundle:
            self._switch("previous", old)
            crash.point("previous-switched")
        self._switch("current", bundle, "current-link")

    def restore(self, current: Optional[Path], previous: Optional[Path]) -> None:
        """Put both links back as they were (after a failed health check)."""
        for name, target in (("current", current), ("previous", previous)):
            if target is not None:
                self._switch(name, target)
            elif (self.root / name).is_symlink():
                (self.root / name).unlink()
                fsync_dir(self.root)

    def _switch(self, name: str, target: Path, crash_step: str = "") -> None:
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(os.path.relpath(str(target), str(self.root)), str(tmp))
        if crash_step:
            crash.point(crash_step)
        os.replace(str(tmp), str(self.root / name))
        fsync_dir(self.root)

    def record(self, event: str, **fields: object) -> None:
        """Append one event to the journal (fsynced)."""
        self.root.mkdir(parents=True, exist_ok=True)
        line = json.dumps(dict(time=time.time(), event=event, **fields), sort_keys=True)
        with os.fdopen(open_nofollow(self.journal_path, os.O_RDWR | os.O_APPEND | os.O_CREAT), "ab+") as f:
            torn = False
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            f.write((b"\n" if torn else b"") + line.encode() + b"\n")  # a killed writer's torn line stays alone
            f.flush()
            os.fsync(f.fileno())

    def history(self) -> list:
        """Journal events, oldest first; a line torn by a crash is skipped."""
        if not os.path.lexists(str(self.journal_path)):
            return []
        with os.fdopen(open_nofollow(self.journal_path, os.O_RDONLY), "rb") as f:
            text = f.read().decode(errors="replace")
        events = []
        for line in text.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events

    def installed(self, policy: str) -> list:
        """Installed versions of ``policy``, oldest first."""
        base = self.inside("bundles", PolicyName.parse(policy, check="store"))
        if not base.is_dir():
            return []
        entries = [p for p in base.iterdir() if VERSION.fullmatch(p.name)]
        return sorted((no_link(p).name for p in entries if p.is_symlink() or p.is_dir()), key=int)

    def policies(self) -> list:
        """Policies with a directory under ``bundles/`` (a link there is refused, check ``store``)."""
        base = self.inside("bundles")
        return sorted(no_link(p).name for p in base.iterdir()) if base.is_dir() else []

    def remove(self, bundle: Path) -> None:
        """Delete an installed bundle directory (never one that ``current`` or ``previous`` names)."""
        if bundle in (self.link("current"), self.link("previous")):
            raise ValueError(f"{bundle} is in use; not removed")
        self.inside(*bundle.relative_to(self.root).parts)
        make_writable(bundle)
        shutil.rmtree(str(bundle))
        fsync_dir(bundle.parent)

    def gc(self, keep: int) -> list:
        """Delete all but the newest ``keep`` versions of each policy, never ``current`` or ``previous``."""
        pinned = {self.link("current"), self.link("previous")}
        removed = []
        for policy in self.policies():
            versions = self.installed(policy)
            for version in versions[: max(0, len(versions) - keep)]:
                path = self.bundle_dir(policy, version)
                if path in pinned:
                    continue
                self.remove(path)
                removed.append(f"{policy}/{version}")
        if removed:
            self.record("gc", removed=removed, keep=keep)
        return removed

    def current_manifest(self) -> Optional[dict]:
        current = self.link("current")
        return json.loads((current / "manifest.json").read_text()) if current else None
