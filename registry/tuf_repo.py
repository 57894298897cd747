"""Publish a registered bundle into a TUF repository (python-tuf's Metadata API): static files any HTTP server serves.

Layout of ``repo`` (served as is; ``consistent_snapshot`` is off, so file names are plain)::

    metadata/root.json, <N>.root.json    the trust anchor (devices get root.json out of band: ``--tuf-root``);
                                         each version a root rotation wrote, 1 to N
    metadata/targets.json                every published bundle, with the custom fields below
    metadata/snapshot.json               the version of targets.json
    metadata/timestamp.json              the version of snapshot.json; short-lived, re-signed on every publish
    targets/<policy>/<version>.tar       the bundle, byte for byte as registered
    targets/<policy>/latest.tar          a copy of the highest version published (``pull --tuf URL <policy>``)
    targets/<policy>/rollout.json        while a staged rollout runs: each ring's version (edge/rollout_plan.py);
                                         devices asking for ``<policy>`` follow it instead of latest.tar

Keys (``keys``, never served): per role, ``<role>.key`` then ``<role>-2.key`` … ``<role>-<N>.key``, each an
Ed25519 private key (PKCS#8 PEM, mode 0600), made when a repository is created. ``keys/layout.json`` (optional)
gives each role N keys and a threshold T, e.g. ``{"root": {"keys": 3, "threshold": 2}, "targets": {"keys": 2,
"threshold": 2}}``; a role it leaves out (or no file: every role) has 1 key, threshold 1. Root lists every key
with its threshold; a publish signs each role with every key of it present and is refused, before anything is
written, when fewer than the threshold root.json names are present. A root key rotation
(registry/tuf_rotation.py) writes ``metadata/<N+1>.root.json`` naming the keys and thresholds of another such
directory.

Each target's ``custom`` field (the device checks it against the registry contract and the signed manifest)::

    {"sim2edge": {"policy": "<name>", "version": "<n>", "target": "<profile>", "bundle_sha256": "<64 hex>"}}

Every publish bumps the versions of targets, snapshot and timestamp and renews their expiries.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edge import bundle
from edge.errors import CheckFailed

ROLES = ("root", "targets", "snapshot", "timestamp")
CUSTOM = "sim2edge"
LAYOUT = "layout.json"


class RepoConfig(BaseModel):
    """A repository, its keys and the lifetimes of what a change re-signs."""

    model_config = ConfigDict(frozen=True)
    repo: Path = Field(description="Repository directory (served as static files).")
    keys: Path = Field(description="Directory of the role keys (made on first use; never served).")
    root_days: float = Field(365.0, gt=0, description="Lifetime of root.json.")
    targets_days: float = Field(90.0, gt=0, description="Lifetime of targets.json.")
    snapshot_days: float = Field(7.0, gt=0, description="Lifetime of snapshot.json.")
    timestamp_s: float = Field(86400.0, gt=0, description="Lifetime of timestamp.json: how long a frozen "
                                                          "repository can fool a device.")


class PublishConfig(RepoConfig):
    """One bundle into one repository."""

    bundle: Path = Field(description="The bundle tar as registered.")
    policy: str = Field(description="Registered model the bundle belongs to.")
    version: str = Field(description="Its registered version.")
    move_latest: bool = Field(True, description="Point <policy>/latest.tar at it when it is the newest (a staged "
                                                "rollout publishes without: its rollout.json directs devices).")


class Published(BaseModel):
    """What was published where."""

    model_config = ConfigDict(frozen=True)
    target_path: str
    latest: bool = Field(description="Whether <policy>/latest.tar now names this version.")
    sha256: str
    size: int
    targets_version: int
    snapshot_version: int
    timestamp_version: int


def _manifest(tar: Path) -> dict:
    """The bundle's manifest (parsed, not authenticated: the device does that)."""
    try:
        with tarfile.open(tar) as t:
            member = t.getmember(bundle.MANIFEST)
            if member.size > bundle.MAX_MANIFEST_BYTES:
                raise ValueError(f"{bundle.MANIFEST} is {member.size} bytes")
            return bundle.parse_manifest(t.extractfile(member).read())
    except (KeyError, tarfile.TarError, OSError, ValueError, CheckFailed) as e:
        raise ValueError(f"{tar} is not a sim2edge bundle ({e})") from None


class RoleKeys(BaseModel):
    """How many keys a role has and how many of them must sign its metadata."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    keys: int = Field(1, ge=1)
    threshold: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _reachable(self) -> "RoleKeys":
        if self.threshold > self.keys:
            raise ValueError(f"threshold {self.threshold} exceeds its {self.keys} key(s)")
        return self


def key_layout(keys: Path) -> dict[str, RoleKeys]:
    """Each role's key count and threshold from ``keys/layout.json``; 1 of 1 for a role it leaves out."""
    path = keys / LAYOUT
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(raw, dict) or set(raw) - set(ROLES):
            raise ValueError(f"roles are {', '.join(ROLES)}")
        return {role: RoleKeys(**raw.get(role, {})) for role in ROLES}
    except (TypeError, ValueError, ValidationError) as e:
        why = " ".join(str(e).split())
        raise ValueError(f"{path} is not a key layout ({why})") from None


def key_path(keys: Path, role: str, i: int) -> Path:
    """Key ``i`` (from 1) of ``role``: ``<role>.key`` for the first, ``<role>-<i>.key`` after it."""
    return keys / (f"{role}.key" if i == 1 else f"{role}-{i}.key")


def role_signers(keys: Path, create: bool = True) -> dict[str, list]:
    """Each role's signers from the key files in ``keys`` its layout names; missing ones generated when ``create``,
    skipped otherwise."""
    from securesystemslib.signer import CryptoSigner

    layout = key_layout(keys)
    if create:
        keys.mkdir(parents=True, exist_ok=True)
    signers = {}
    for role in ROLES:
        paths = [key_path(keys, role, i) for i in range(1, layout[role].keys + 1)]
        for path in paths:
            if create and not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(CryptoSigner.generate_ed25519().private_bytes)
        signers[role] = [load_signer(path) for path in paths if path.exists()]
    return signers


def load_signer(path: Path):
    """The signer of the private key (PKCS#8 PEM, unencrypted) in ``path``."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner

    try:
        return CryptoSigner(load_pem_private_key(path.read_bytes(), None))
    except (TypeError, ValueError) as e:
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{path} is not an unencrypted PEM private key ({why})") from None


def expiry(seconds: float) -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=seconds)


def _write(md, path: Path) -> None:
    """Write metadata atomically: a client never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(md.to_bytes())
    os.replace(tmp, path)


def _open(cfg: RepoConfig) -> tuple[dict, dict]:
    """The four roles as stored and each role's signers among ``cfg.keys`` (at least its threshold, else
    ValueError before anything is written), or a new repository (root written at once) of those keys."""
    from tuf.api.metadata import Metadata

    meta = cfg.repo / "metadata"
    if not (meta / "root.json").exists():
        return _init(meta, role_signers(cfg.keys), cfg)
    signers = role_signers(cfg.keys, create=False)
    md = {role: Metadata.from_file(str(meta / f"{role}.json")) for role in ROLES}
    return md, {role: enough(md["root"].signed, role, signers[role], f"{cfg.keys} holds", meta / "root.json")
                for role in ROLES}


def enough(root, role: str, signers: list, holder: str, where: Path) -> list:
    """The ``signers`` whose keys ``root`` names for ``role``; ValueError in one line when fewer than its threshold."""
    keyids, threshold = root.roles[role].keyids, root.roles[role].threshold
    mine = [s for s in signers if s.public_key.keyid in keyids]
    if len(mine) < threshold:
        raise ValueError(f"{holder} {len(mine)} {role} key(s) of {where}, threshold {threshold}: sign with the key "
                         f"directory that made this repository")
    return mine


def _init(meta: Path, signers: dict, cfg: RepoConfig) -> tuple[dict, dict]:
    """A new repository whose roles have the keys of ``signers`` and the thresholds of ``cfg.keys``' layout."""
    from tuf.api.metadata import Metadata, Root, Snapshot, Targets, Timestamp

    for role in ROLES:
        if (meta / f"{role}.json").exists():
            raise ValueError(f"{meta} has {role}.json but no root.json: not a repository this command made")
    root = Root(expires=expiry(cfg.root_days * 86400), consistent_snapshot=False)
    for role, layout in key_layout(cfg.keys).items():
        for signer in signers[role]:
            root.add_key(signer.public_key, role)
        root.roles[role].threshold = layout.threshold
    md = {"root": Metadata(root), "targets": Metadata(Targets()), "snapshot": Metadata(Snapshot()),
          "timestamp": Metadata(Timestamp())}
    for role in ("targets", "snapshot", "timestamp"):
        md[role].signed.version = 0  # publish bumps each to 1
    sign_all(md["root"], signers["root"])
    meta.mkdir(parents=True, exist_ok=True)
    _write(md["root"], meta / "1.root.json")
    _write(md["root"], meta / "root.json")
    return md, signers


def sign_all(md, signers: list) -> None:
    """Replace the signatures of ``md`` with those of every signer."""
    md.signatures.clear()
    for signer in signers:
        md.sign(signer, append=True)


def _target(repo: Path, path: str, local: Path, custom: dict):
    from tuf.api.metadata import TargetFile

    dest = repo / "targets" / path
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(local, tmp)
    os.replace(tmp, dest)
    return TargetFile(dest.stat().st_size, {"sha256": bundle.sha256_path(dest)}, path, {"custom": {CUSTOM: custom}})


def publish(cfg: PublishConfig) -> Published:
    """Add ``cfg.bundle`` as target ``<policy>/<version>.tar`` (and ``latest.tar`` if it is the newest), then
    re-sign targets, snapshot and timestamp with bumped versions."""
    m = _manifest(cfg.bundle)
    said = (m["policy"]["name"], str(m["policy"]["version"]))
    if said != (cfg.policy, str(cfg.version)):
        raise ValueError(f"{cfg.bundle} is {said[0]} v{said[1]}, not {cfg.policy} v{cfg.version} as registered")
    md, signers = _open(cfg)
    custom = {"policy": cfg.policy, "version": str(cfg.version), "target": m["target"]["name"],
              "bundle_sha256": bundle.sha256_path(cfg.bundle)}
    targets = md["targets"].signed
    path = f"{cfg.policy}/{cfg.version}.tar"
    targets.targets[path] = _target(cfg.repo, path, cfg.bundle, custom)
    latest_path = f"{cfg.policy}/latest.tar"
    latest = targets.targets.get(latest_path)
    newest = cfg.move_latest and (latest is None or
                                  int(latest.unrecognized_fields["custom"][CUSTOM]["version"]) <= int(cfg.version))
    if newest:
        targets.targets[latest_path] = _target(cfg.repo, latest_path, cfg.bundle, custom)
    _sign(md, signers, cfg.repo / "metadata", cfg)
    info = targets.targets[path]
    return Published(target_path=path, latest=newest, sha256=info.hashes["sha256"], size=info.length,
                     targets_version=targets.version, snapshot_version=md["snapshot"].signed.version,
                     timestamp_version=md["timestamp"].signed.version)


def _sign(md: dict, signers: dict, meta: Path, cfg: RepoConfig) -> None:
    """Bump and renew targets, snapshot and timestamp, sign them and write them, timestamp last."""
    resign(md, signers, cfg)
    for role in ("targets", "snapshot", "timestamp"):  # timestamp last: clients start there
        _write(md[role], meta / f"{role}.json")


def resign(md: dict, signers: dict, cfg: RepoConfig) -> None:
    """Bump and renew targets, snapshot and timestamp in ``md`` and sign each with its signers alone (in memory)."""
    from tuf.api.metadata import MetaFile

    targets = md["targets"].signed
    targets.version += 1
    targets.expires = expiry(cfg.targets_days * 86400)
    snapshot = md["snapshot"].signed
    snapshot.meta["targets.json"] = MetaFile(targets.version)
    snapshot.version += 1
    snapshot.expires = expiry(cfg.snapshot_days * 86400)
    timestamp = md["timestamp"].signed
    timestamp.snapshot_meta = MetaFile(snapshot.version)
    timestamp.version += 1
    timestamp.expires = expiry(cfg.timestamp_s)
    for role in ("targets", "snapshot", "timestamp"):
        sign_all(md[role], signers[role])


def published_versions(repo: Path, policy: str) -> set[str]:
    """The versions of ``policy`` the repository's signed targets name."""
    from tuf.api.metadata import Metadata

    path = repo / "metadata" / "targets.json"
    if not path.exists():
        return set()
    found = Metadata.from_file(str(path)).signed.targets
    return {t.unrecognized_fields["custom"][CUSTOM]["version"] for p, t in found.items()
            if p.startswith(f"{policy}/") and p.endswith(".tar") and p != f"{policy}/latest.tar"}


def write_rollout(cfg: RepoConfig, policy: str, plan: dict) -> int:
    """Publish ``plan`` (edge/rollout_plan.py's ``rollout.json``; every version it names already published) as
    target ``<policy>/rollout.json``, or withdraw it when ``plan`` is None; returns the new targets version."""
    from edge.rollout_plan import parse_plan

    data = json.dumps(plan, sort_keys=True).encode() if plan is not None else None
    if data is not None:
        parsed = parse_plan(data, policy)
        missing = {v for v in [parsed.default, *(r.version for r in parsed.rings)] if v} - published_versions(
            cfg.repo, policy)
        if missing:
            raise ValueError(f"rollout of {policy} names version(s) {sorted(missing)} not published in {cfg.repo}")
    md, signers = _open(cfg)
    path = f"{policy}/rollout.json"
    if data is None:
        md["targets"].signed.targets.pop(path, None)
    else:
        local = cfg.repo / "targets" / policy / "rollout.json.new"
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
        md["targets"].signed.targets[path] = _target(cfg.repo, path, local, {"policy": policy, "rollout": True})
        local.unlink()
    _sign(md, signers, cfg.repo / "metadata", cfg)
    return md["targets"].signed.version


def tag_published(client, policy: str, version: str, repo: Path, done: Published) -> None:
    """MLflow stays the system of record: tag the version ``sim2edge.tuf`` with what was published where."""
    client.set_model_version_tag(policy, version, "sim2edge.tuf",
                                 json.dumps({"repo": str(Path(repo).resolve()), **done.model_dump()}, sort_keys=True))
