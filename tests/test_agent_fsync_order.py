"""Power-loss safety as system-call order: the real ``sim2edge-agent pull`` under ``strace``.

Every file the store writes is fsynced before it is closed (so before the rename that publishes it), every
directory a staged bundle's files were created in is fsynced before the bundle's rename, and after every rename
the destination directory is fsynced before the next rename, journal write or exit: installs, the
``current``/``previous`` switches, the journal, ``failed.json``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.agent_checks import genuine, offer_tar
from tests.bundles import make_keys

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (make test installs it as root)")

CALLS = "openat,write,fsync,fdatasync,rename,renameat,renameat2,symlink,symlinkat,close"
LINE = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\)\s+= (-?\d+)(?:<(.*)>)?")
FD = re.compile(r"^\d+<(.*?)>(?:, |$)")
AT = re.compile(r"(?:AT_FDCWD|\d+)<([^>]*)>, \"([^\"]*)\"")


def traced_pull(registry, root: Path, pub: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    """Run ``sim2edge-agent pull tiny@champion`` under strace; its result and its calls (all processes) in time order."""
    out.mkdir()
    exe = Path(sys.executable).parent / "sim2edge-agent"
    r = subprocess.run(["strace", "-ff", "-ttt", "-s", "0", "-y", "-o", str(out / "t"), "-e", f"trace={CALLS}",
                        str(exe), "pull", "tiny@champion", "--registry", registry.url, "--root", str(root),
                        "--trust", str(pub), "--skip-target-check", "--attempts", "1", "--backoff", "0",
                        "--ignore-backoff", *extra], capture_output=True, text=True, cwd=out, timeout=300)
    events = []
    for f in out.iterdir():  # one file per process (-ff): no call is split across lines
        for line in f.read_text().splitlines():
            if (m := LINE.match(line)) and int(m[4]) >= 0:
                events.append((float(m[1]), m[2], m[3], m[5] or ""))
    events.sort()
    return r, events


@dataclass
class Order:
    """Replays a trace and collects every violation of the module docstring's rules under ``root``."""

    root: str
    cwd: str
    wrote: dict = field(default_factory=dict)      # path -> time of the last write
    synced: dict = field(default_factory=dict)     # path (file or directory) -> time of the last fsync
    created: dict = field(default_factory=dict)    # path -> time of its creation
    pending: dict = field(default_factory=dict)    # directory -> the rename that waits for its fsync
    renames: list = field(default_factory=list)
    journal_writes: int = 0
    errors: list = field(default_factory=list)

    def ours(self, path: str) -> bool:
        return path.startswith(self.root + "/")

    def dirty(self, path: str) -> bool:
        return path in self.wrote and self.synced.get(path, -1) < self.wrote[path]

    def barrier(self, what: str) -> None:
        for d, rename in self.pending.items():
            self.errors.append(f"{what} before {d} was fsynced after {rename}")
        self.pending.clear()

    def replay(self, events) -> "Order":
        for t, call, args, retpath in events:
            fd = FD.match(args)
            path = fd[1] if fd else ""
            if call == "openat" and "O_CREAT" in args and self.ours(retpath):
                self.created.setdefault(retpath, t)
            elif call == "write" and self.ours(path):
                if path.endswith("/journal.jsonl"):
                    self.barrier(f"journal write at {t}")
                    self.journal_writes += 1
                self.wrote[path] = t
            elif call in ("fsync", "fdatasync") and (self.ours(path) or path == self.root):
                self.synced[path] = t
                self.pending.pop(path, None)
            elif call == "close" and self.ours(path) and self.dirty(path) and not path.endswith("/lock"):
                self.errors.append(f"{path} closed with writes not fsynced")
            elif call.startswith("rename"):
                self.rename(*self.paths(call, args))
        self.barrier("exit")
        return self

    def paths(self, call: str, args: str) -> tuple[str, str]:
        pairs = AT.findall(args) if call != "rename" else [(self.cwd, p) for p in re.findall(r"\"([^\"]*)\"", args)]
        (d1, p1), (d2, p2) = pairs[:2]
        return os.path.join(d1, p1), os.path.join(d2, p2)

    def rename(self, src: str, dst: str) -> None:
        if not self.ours(dst):
            return
        self.barrier(f"rename {src} -> {dst}")
        for p in [src, *(p for p in self.created if p.startswith(src + "/"))]:
            if self.dirty(p):
                self.errors.append(f"{p} renamed into {dst} before it was fsynced")
            parent = os.path.dirname(p)
            if p != src and p in self.created and self.synced.get(parent, -1) < self.created[p]:
                self.errors.append(f"{parent} renamed into {dst} before it was fsynced after {p} was created")
        self.renames.append((src, dst))
        self.pending[os.path.dirname(dst)] = f"rename {src} -> {dst}"


def check(registry, root: Path, pub: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Order]:
    r, events = traced_pull(registry, root, pub, out, *extra)
    order = Order(str(root), str(out)).replay(events)
    assert not order.errors, "\n".join(order.errors)
    return r, order


def test_pull_fsyncs_before_every_rename_and_the_directory_after(tmp_path, keys, registry, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2", pad_bytes=70_000), version="2")
    r, order = check(registry, active, keys[1], tmp_path / "trace-install")
    assert r.returncode == 0, r.stderr
    dsts = [os.path.relpath(d, active) for _, d in order.renames]
    assert "bundles/tiny/2" in dsts and {"previous", "current"} <= set(dsts), dsts
    assert dsts.index("previous") < dsts.index("current") and order.journal_writes >= 1

    other = make_keys(tmp_path, "other")
    offer_tar(registry, genuine(tmp_path, other[0], "3"), version="3")  # signed by a key the device does not trust
    r, order = check(registry, active, keys[1], tmp_path / "trace-failed")
    assert r.returncode == 1 and "signature" in r.stderr, r.stderr
    assert "failed.json" in [os.path.basename(d) for _, d in order.renames] and order.journal_writes >= 1


def test_a_download_cut_short_keeps_an_fsynced_part(tmp_path, keys, registry, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    registry.drip_s = 0.01  # the deadline cuts the body short: what arrived is the next pull's resume point
    r, order = check(registry, active, keys[1], tmp_path / "trace-cut", "--deadline", "2")
    assert r.returncode == 3, r.stderr
    assert [p for p in order.synced if p.endswith(".part") and "/downloads/" in p], order.synced
