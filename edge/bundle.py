"""The bundle: one tar file, the contract between the pipeline and the device.

Members: ``manifest.json``, ``manifest.sig`` (detached Ed25519 over the manifest's exact
bytes), ``policy.onnx``, ``golden.npz``, and optional ``polygraphy_inputs.json`` /
``polygraphy_outputs.json`` (the golden rows in Polygraphy's formats, for ``polygraphy run
--load-inputs/--load-outputs`` on the device) and ``engines/<key>.plan``. The
manifest lists every other member's sha256 and length. The writer and the reader live
here together so they cannot drift; the pipeline writes through :func:`write_bundle`.

The reader authenticates before it unpacks (:func:`extract`): it reads at most
:data:`MAX_MEMBERS` tar headers, then the manifest and its signature (bounded in size) from the
tar, verifies the signature against the pinned keys and parses the manifest (:func:`parse_manifest`),
and refuses the archive unless its members are exactly the listed files with the listed lengths.
Only then does anything reach the disk: each listed member, streamed to at most its signed length
and hashed on the way. A refusal is a :class:`~edge.errors.CheckFailed` naming its check.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Callable, Dict, Iterable, Optional

from edge import crash
from edge.errors import CheckFailed, is_disk_full
from edge.signing import verify
from edge.values import PolicyName, Sha256, Version, byte_count, shown

FORMAT = "sim2edge-bundle"
FORMAT_VERSION = 1
MANIFEST, SIGNATURE = "manifest.json", "manifest.sig"
REQUIRED = ("policy.onnx", "golden.npz")
ENGINES = "engines"
_MEMBER = re.compile(r"(engines/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_MANIFEST_BYTES = 1 << 20
MAX_SIGNATURE_BYTES = 1024
MAX_MEMBERS = 64
"""Tar headers read before refusing an archive (a bundle has the manifest, its signature and a few files)."""
_TAR_ERRORS = (tarfile.TarError, OSError, EOFError, UnicodeError, ValueError)
"""What ``tarfile`` raises on a damaged or hostile archive (all are refused as check ``archive``)."""


def member_name_ok(name: str) -> bool:
    """A file member's name: one plain component, or ``engines/<plain>``; ``engines`` itself is the folder."""
    return bool(_MEMBER.fullmatch(name)) and name != ENGINES


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
        if not member_name_ok(name) or name in (MANIFEST, SIGNATURE):
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


def _headers(tar: tarfile.TarFile, name: str) -> Dict[str, tarfile.TarInfo]:
    """At most :data:`MAX_MEMBERS` headers, each a regular file with an allowed, unique name."""
    headers: Dict[str, tarfile.TarInfo] = {}
    try:
        while True:
            info = tar.next()
            if info is None:
                return headers
            if len(headers) == MAX_MEMBERS:
                raise CheckFailed("archive", f"{name} has more than {MAX_MEMBERS} members")
            if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise CheckFailed("archive", f"member {shown(info.name)} is not a regular file "
                                             f"(links, directories, devices and sparse files are refused)")
            if not member_name_ok(info.name) and info.name not in (MANIFEST, SIGNATURE):
                raise CheckFailed("archive", f"member path {shown(info.name)} is not allowed "
                                             f"(absolute, '..' or odd name)")
            if info.name in headers:
                raise CheckFailed("archive", f"member {shown(info.name)} appears twice")
            headers[info.name] = info
    except _TAR_ERRORS as e:
        raise CheckFailed("archive", f"{name} is damaged or truncated ({type(e).__name__}: {e})") from None


def _copy(src: IO[bytes], out: IO[bytes], length: int) -> str:
    """Copy exactly ``length`` bytes (no more are read); returns their sha256, or raises on a short member."""
    h = hashlib.sha256()
    left = length
    while left:
        chunk = src.read(min(left, 1 << 20))
        if not chunk:
            raise EOFError(f"{length - left} of {length} bytes")
        h.update(chunk)
        out.write(chunk)
        left -= len(chunk)
    return h.hexdigest()


def _member_bytes(tar: tarfile.TarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    if info.size > limit:
        raise CheckFailed("manifest", f"member {info.name} is {info.size} bytes, more than {limit}")
    try:
        src = tar.extractfile(info)
        data = src.read(info.size) if src else b""
    except _TAR_ERRORS as e:
        raise CheckFailed("archive", f"member {info.name} cannot be read ({type(e).__name__}: {e})") from None
    if len(data) != info.size:
        raise CheckFailed("archive", f"member {info.name} is truncated")
    return data


def extract(tar_path: Path, dest: Path, max_bytes: int, trusted: Optional[Iterable] = None) -> dict:
    """Authenticate the bundle ``tar_path``, then unpack its listed files into the directory ``dest``.

    See the module docstring for the order of checks; ``max_bytes`` bounds the total unpacked size.
    ``trusted=None`` skips only the signature check (the build host reading a bundle it just wrote;
    the device always passes its pinned keys): names, member count, lengths and hashes are checked
    either way. Returns the parsed manifest; on a refusal ``dest`` holds at most the members written
    so far (the caller removes it)."""
    if tar_path.stat().st_size == 0:
        raise CheckFailed("archive", f"{tar_path.name} is empty (0 bytes)")
    try:
        tar = tarfile.open(tar_path, mode="r:")
    except _TAR_ERRORS as e:
        raise CheckFailed("archive", f"{tar_path.name} is not a readable tar file ({type(e).__name__}: {e})") from None
    with tar:
        headers = _headers(tar, tar_path.name)
        for required in (MANIFEST, SIGNATURE):
            if required not in headers:
                raise CheckFailed("signature" if required == SIGNATURE else "manifest",
                                  f"{required} is missing" + (" (unsigned bundle)" if required == SIGNATURE else ""))
        body = _member_bytes(tar, headers[MANIFEST], MAX_MANIFEST_BYTES)
        signature = _member_bytes(tar, headers[SIGNATURE], MAX_SIGNATURE_BYTES)
        manifest = authenticate(body, signature, trusted) if trusted is not None else parse_manifest(body)
        listed = manifest["files"]
        present = set(headers) - {MANIFEST, SIGNATURE}
        _check_listed(listed, present)
        for name in sorted(listed):
            if headers[name].size != listed[name]["length"]:
                raise CheckFailed("length", f"{name!r} is {headers[name].size} bytes, manifest says "
                                            f"{listed[name]['length']}")
        total = sum(meta["length"] for meta in listed.values())
        if total > max_bytes:
            raise CheckFailed("size", f"bundle unpacks to {total} bytes, more than {max_bytes}")
        for name in sorted(listed):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as out:
                try:
                    src = tar.extractfile(headers[name])
                    digest = _copy(src, out, listed[name]["length"]) if src else sha256_bytes(b"")
                except _TAR_ERRORS as e:
                    if is_disk_full(e):  # the device's storage, not the bundle: the caller says `disk`
                        raise
                    raise CheckFailed("archive", f"member {name!r} cannot be read ({type(e).__name__}: {e})") from None
                out.flush()
                os.fsync(out.fileno())
            if digest != listed[name]["sha256"]:
                raise CheckFailed("hash", f"{name!r} sha256 does not match the manifest")
            crash.point("extract")
    for name, data in ((MANIFEST, body), (SIGNATURE, signature)):
        with open(dest / name, "xb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    return manifest


def _check_listed(listed: dict, present: set) -> None:
    for problem, names in (("required file {!r} is not in the manifest", set(REQUIRED) - set(listed)),
                           ("extra file {!r} is not in the manifest", present - set(listed)),
                           ("file {!r} listed in the manifest is missing", set(listed) - present)):
        if names:
            raise CheckFailed("files", problem.format(sorted(names)[0]))


def _number(value: object, field: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise CheckFailed("manifest", f"{field} {shown(value)} is not a {'positive' if positive else 'non-negative'} "
                                      f"finite number")
    return float(value)


def _object(parent: dict, key: str, field: str) -> dict:
    value = parent.get(key)
    if not isinstance(value, dict):
        raise CheckFailed("manifest", f"{field} is missing or not an object")
    return value


def parse_manifest(body: bytes) -> dict:
    """The manifest's JSON, with every field the agent reads checked for presence and type.

    Runs on signed bytes only, yet a trusted key can still sign a malformed manifest: each gap is a
    one-line refusal (check ``manifest`` or ``format``), never a KeyError later."""
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise CheckFailed("manifest", f"{MANIFEST} is not JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckFailed("manifest", f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckFailed("format", f"unknown bundle format {shown(manifest.get('format'))} version "
                                    f"{shown(manifest.get('format_version'))} (this agent reads {FORMAT} v{FORMAT_VERSION})")
    policy = _object(manifest, "policy", "policy")
    PolicyName.parse(policy.get("name"), "policy.name", "manifest")
    Version.parse(policy.get("version"), "policy.version", "manifest")
    if not isinstance(_object(manifest, "target", "target").get("name"), str):
        raise CheckFailed("manifest", "target.name is missing or not a string")
    _number(_object(manifest, "control", "control").get("period_s"), "control.period_s", positive=True)
    for precision, tol in _object(manifest, "parity_tolerance", "parity_tolerance").items():
        if not isinstance(tol, dict):
            raise CheckFailed("manifest", f"parity_tolerance.{precision} is not an object")
        for k in ("atol", "rtol"):
            _number(tol.get(k), f"parity_tolerance.{precision}.{k}")
    if "fp32" not in manifest["parity_tolerance"]:
        raise CheckFailed("manifest", "parity_tolerance.fp32 is missing")
    files = _object(manifest, "files", "files")
    for name, meta in files.items():
        if not member_name_ok(name) or name in (MANIFEST, SIGNATURE):
            raise CheckFailed("manifest", f"files lists {shown(name)}, not an allowed member name")
        if not isinstance(meta, dict):
            raise CheckFailed("manifest", f"files.{name} is not an object")
        Sha256.parse(meta.get("sha256"), f"files.{name}.sha256", "manifest")
        if not isinstance(meta.get("length"), int):
            raise CheckFailed("manifest", f"files.{name}.length {shown(meta.get('length'))} is not an integer")
        byte_count(meta["length"], f"files.{name}.length", check="manifest")
    for optional in ("provenance", "runtime", "io"):
        if optional in manifest and not isinstance(manifest[optional], dict):
            raise CheckFailed("manifest", f"{optional} is not an object")
    if "io" in manifest:
        _check_io(manifest["io"])
    evaluation = manifest.get("evaluation")
    if evaluation is not None and not (isinstance(evaluation, dict)
                                       and isinstance(evaluation.get("passed", True), bool)):
        raise CheckFailed("manifest", "evaluation is not an object with a boolean 'passed'")
    return manifest


def _check_io(io_spec: dict) -> None:
    """``io.input.terms`` and ``io.output.terms`` name their terms; ``low``/``high``/``default`` match the outputs."""
    counts: Dict[str, int] = {}
    for side in ("input", "output"):
        terms = _object(io_spec, side, f"io.{side}").get("terms")
        if not isinstance(terms, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                  for t in terms):
            raise CheckFailed("manifest", f"io.{side}.terms is not a list of named terms")
        counts[side] = len(terms)
    for key in ("low", "high", "default"):
        values = io_spec["output"].get(key)
        if not isinstance(values, list) or len(values) != counts["output"] or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise CheckFailed("manifest", f"io.output.{key} is not a list of {counts['output']} finite numbers")


def authenticate(body: bytes, signature: bytes, trusted: Iterable) -> dict:
    """Check the detached signature over the manifest's exact bytes, then parse them."""
    if len(body) > MAX_MANIFEST_BYTES:
        raise CheckFailed("manifest", f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    if not verify(trusted, body, signature):
        raise CheckFailed("signature", "manifest signature does not match any trusted key")
    return parse_manifest(body)


def verify_dir(bundle_dir: Path, trusted: Iterable) -> dict:
    """Verify an unpacked bundle; return its manifest. Raises :class:`CheckFailed` naming the check."""
    manifest_path, sig_path = bundle_dir / MANIFEST, bundle_dir / SIGNATURE
    if not manifest_path.is_file():
        raise CheckFailed("manifest", f"{MANIFEST} is missing")
    if not sig_path.is_file():
        raise CheckFailed("signature", f"{SIGNATURE} is missing (unsigned bundle)")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckFailed("manifest", f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    manifest = authenticate(manifest_path.read_bytes(), sig_path.read_bytes(), trusted)
    listed = manifest["files"]
    present = {str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file() or p.is_symlink()}
    _check_listed(listed, present - {MANIFEST, SIGNATURE})
    for name, meta in sorted(listed.items()):
        path = bundle_dir / name
        if path.is_symlink():
            raise CheckFailed("files", f"{name!r} is a link")
        if path.stat().st_size != meta["length"]:
            raise CheckFailed("length", f"{name!r} is {path.stat().st_size} bytes, manifest says {meta['length']}")
        if sha256_path(path) != meta["sha256"]:
            raise CheckFailed("hash", f"{name!r} sha256 does not match the manifest")
    return manifest
