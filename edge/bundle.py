"""The bundle: one tar file, the contract between the pipeline and the device.

Members: ``manifest.json``, ``manifest.sig`` (detached Ed25519 over the manifest's exact
bytes), ``policy.onnx``, ``golden.npz``, and optional ``polygraphy_inputs.json`` /
``polygraphy_outputs.json`` (the golden rows in Polygraphy's formats, for ``polygraphy run
--load-inputs/--load-outputs`` on the device) and ``engines/<key>.plan``. The
manifest lists every other member's sha256 and length. The writer and the reader live
here together so they cannot drift; the pipeline writes through :func:`write_bundle`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterable

from edge import crash
from edge.errors import CheckFailed
from edge.signing import verify

FORMAT = "sim2edge-bundle"
FORMAT_VERSION = 1
MANIFEST, SIGNATURE = "manifest.json", "manifest.sig"
REQUIRED = ("policy.onnx", "golden.npz")
_MEMBER = re.compile(r"^(engines/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_MANIFEST_BYTES = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_bytes(manifest: dict) -> bytes:
    """The canonical serialization that gets signed."""
    return json.dumps(manifest, sort_keys=True, indent=2).encode()


def write_bundle(out: Path, files: Dict[str, bytes], manifest: dict, sign: Callable[[bytes], bytes]) -> str:
    """Write a deterministic, signed bundle to ``out`` atomically; return its sha256.

    ``manifest`` is completed with the format and every file's sha256 and length.
    Same inputs give the same bytes: sorted members, zero mtimes, root owner, fixed modes.
    """
    for name in files:
        if not _MEMBER.match(name) or name in (MANIFEST, SIGNATURE):
            raise ValueError(f"bundle member name {name!r} is not allowed")
    full = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION,
                files={n: {"sha256": sha256_bytes(b), "length": len(b)} for n, b in sorted(files.items())})
    body = manifest_bytes(full)
    members = dict(files, **{MANIFEST: body, SIGNATURE: sign(body)})
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=str(out.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for name in sorted(members):
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(members[name]), 0o644, 0
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    tar.addfile(info, io.BytesIO(members[name]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return sha256_path(out)


def extract(tar_path: Path, dest: Path, max_bytes: int) -> None:
    """Unpack ``tar_path`` into the empty directory ``dest``, refusing anything unsafe.

    Only regular files with plain names are accepted: no links, devices, directories,
    absolute paths or ``..``; no duplicates; at most ``max_bytes`` in total.
    """
    total = 0
    seen = set()
    try:
        tar = tarfile.open(tar_path, mode="r:")
    except (tarfile.TarError, OSError) as e:
        raise CheckFailed("archive", f"{tar_path.name} is not a readable tar file ({e})") from e
    with tar:
        try:
            members = tar.getmembers()
        except (tarfile.TarError, OSError) as e:
            raise CheckFailed("archive", f"{tar_path.name} is damaged or truncated ({e})") from e
        for info in members:
            if not info.isreg():
                raise CheckFailed("archive", f"member {info.name!r} is not a regular file (links and devices are refused)")
            if not _MEMBER.match(info.name) and info.name not in (MANIFEST, SIGNATURE):
                raise CheckFailed("archive", f"member path {info.name!r} is not allowed (absolute, '..' or odd name)")
            if info.name in seen:
                raise CheckFailed("archive", f"member {info.name!r} appears twice")
            seen.add(info.name)
            total += info.size
            if total > max_bytes:
                raise CheckFailed("size", f"bundle unpacks to more than {max_bytes} bytes")
            target = dest / info.name
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(info)
            with open(target, "wb") as out:
                data = src.read() if src else b""
                if len(data) != info.size:
                    raise CheckFailed("archive", f"member {info.name!r} is truncated")
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            crash.point("extract")


def verify_dir(bundle_dir: Path, trusted: Iterable) -> dict:
    """Verify an unpacked bundle; return its manifest. Raises :class:`CheckFailed` naming the check."""
    manifest_path, sig_path = bundle_dir / MANIFEST, bundle_dir / SIGNATURE
    if not manifest_path.is_file():
        raise CheckFailed("manifest", f"{MANIFEST} is missing")
    if not sig_path.is_file():
        raise CheckFailed("signature", f"{SIGNATURE} is missing (unsigned bundle)")
    body = manifest_path.read_bytes()
    if len(body) > MAX_MANIFEST_BYTES:
        raise CheckFailed("manifest", f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    if not verify(trusted, body, sig_path.read_bytes()):
        raise CheckFailed("signature", "manifest signature does not match any trusted key")
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise CheckFailed("manifest", f"{MANIFEST} is not JSON ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckFailed("format", f"unknown bundle format {manifest.get('format')!r} version "
                                    f"{manifest.get('format_version')!r} (this agent reads {FORMAT} v{FORMAT_VERSION})")
    listed = manifest.get("files", {})
    present = {str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file() or p.is_symlink()}
    present -= {MANIFEST, SIGNATURE}
    for problem, names in (("required file {!r} is not in the manifest", set(REQUIRED) - set(listed)),
                           ("extra file {!r} is not in the manifest", present - set(listed)),
                           ("file {!r} listed in the manifest is missing", set(listed) - present)):
        if names:
            raise CheckFailed("files", problem.format(sorted(names)[0]))
    for name, meta in sorted(listed.items()):
        path = bundle_dir / name
        if path.is_symlink():
            raise CheckFailed("files", f"{name!r} is a link")
        if path.stat().st_size != meta["length"]:
            raise CheckFailed("length", f"{name!r} is {path.stat().st_size} bytes, manifest says {meta['length']}")
        if sha256_path(path) != meta["sha256"]:
            raise CheckFailed("hash", f"{name!r} sha256 does not match the manifest")
    return manifest
