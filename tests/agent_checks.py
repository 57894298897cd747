"""What every agent-refusal test shares: a hostile registry, trusted keys, a sibling directory no answer may
touch, an active store, and :func:`assert_refused` (exit code, one stderr line naming the check, a journaled
refusal, nothing left behind, the sibling unchanged, ``current`` still verifying)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from edge import bundle, signing
from edge.store import DeviceStore
from tests.bundles import make_bundle, make_keys
from tests.conftest import run_cli
from tests.hostile_registry import HostileRegistry, model_version

PATH = "1/0123456789abcdef0123456789abcdef/artifacts/bundle/tiny.tar"


@pytest.fixture()
def keys(tmp_path):
    return make_keys(tmp_path)


@pytest.fixture()
def registry():
    r = HostileRegistry()
    yield r
    r.close()


@pytest.fixture()
def sibling(tmp_path) -> Path:
    """A directory beside the store that no registry answer may touch: files, a ``.part``, a subdirectory."""
    d = tmp_path / "sibling"
    (d / "dir").mkdir(parents=True)
    for name, data in (("keep.txt", b"keep"), ("x.part", b"partial"), ("dir/inner.txt", b"inner")):
        (d / name).write_bytes(data)
    (d / "dir").chmod(0o755)
    return d


def snapshot(root: Path) -> dict:
    """Every path below ``root`` with its mode, size, mtime and content digest."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def agent(registry: HostileRegistry, command: str, ref: str, root: Path, pub: Path, *extra: str,
          env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("sim2edge-agent", command, ref, "--registry", registry.url, "--root", str(root), "--trust",
                   str(pub), "--skip-target-check", "--attempts", "1", "--backoff", "0", "--ignore-backoff",
                   *extra, env=env)


def offer_tar(registry: HostileRegistry, tar: bytes, version: object = "2", **fields) -> None:
    """Offer ``tar`` as ``tiny`` v``version`` with tags that tell the truth about it (unless overridden)."""
    answer = dict(path=PATH, sha256=hashlib.sha256(tar).hexdigest(), size=str(len(tar)))
    answer.update(fields)
    registry.offer(model_version("tiny", version, answer["path"], answer["sha256"], answer["size"]), tar)


def genuine(tmp_path: Path, priv: Path, version: str, **kw) -> bytes:
    tar = tmp_path / f"tiny-{version}.tar"
    make_bundle(tar, priv, version=version, name="tiny", **kw)
    return tar.read_bytes()


@pytest.fixture()
def active(tmp_path, keys, registry) -> Path:
    """A device store whose ``current`` is tiny v1, pulled for real from the hostile registry's honest answer."""
    root = tmp_path / "store"
    offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
    r = agent(registry, "pull", "tiny@champion", root, keys[1])
    assert r.returncode == 0, r.stderr
    return root


def assert_refused(r: subprocess.CompletedProcess, check: str, root: Path, sibling: Path, before: dict,
                   pub: Path, code: int = 1) -> None:
    """The one refusal the README promises, and nothing changed where it must not change."""
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sim2edge-agent: {check}: "), r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(sibling) == before
    store = DeviceStore(root)
    if code != 3:  # a transfer cut short may keep its part for a resume (checked by the caller)
        assert not list((root / "downloads").glob("*.part")) if (root / "downloads").exists() else True
    assert not list((root / "tmp").iterdir()) if (root / "tmp").exists() else True
    last = store.history()[-1]
    assert last["event"] in ("refused", "unavailable") and (last.get("check") == check or code == 3), last
    if store.link("current") is not None:
        bundle.verify_dir(store.link("current"), signing.load_trusted([pub]))
