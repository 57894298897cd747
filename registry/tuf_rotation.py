"""Root key rotation of a repository written by registry/tuf_repo.py (TUF specification 5.3.4, python-tuf's
Metadata API).

:func:`rotate_root` writes root version N+1 whose four roles name the keys in ``new_keys`` (a key directory of the
same layout, made on first use; a role whose key file there is a copy of the old one keeps that key), signed by the
old root key, so that a device trusting root N accepts it, and by the new one, so that it verifies on its own as
the next trust anchor. Targets, snapshot and timestamp are then re-signed with the new keys, their versions bumped.
Devices walk the chain themselves: ngclient fetches ``metadata/<N+1>.root.json`` on its next refresh, checks it
against both roots, and from then on accepts only what the new keys sign. The old key directory then signs nothing
a device accepts: retire it, and publish with ``--keys NEW``.

Nothing is written before every file is signed and verified; the five files are then staged as ``*.tmp`` and
renamed over the old ones (``<N+1>.root.json`` and ``root.json`` first, timestamp last), so a refused rotation
leaves the repository as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from registry.tuf_repo import ROLES, RepoConfig, expiry, load_signer, resign, role_signers


class RotateConfig(RepoConfig):
    """A repository, its current keys (``keys``) and the directory of the keys that replace them."""

    new_keys: Path = Field(description="Directory of the new role keys (made on first use; never served).")


class Rotated(BaseModel):
    """The root version written and what changed."""

    model_config = ConfigDict(frozen=True)
    root_version: int
    rotated: list[str] = Field(description="The roles whose key changed (root always).")
    timestamp_version: int


def rotate_root(cfg: RotateConfig) -> Rotated:
    """Write root v N+1 with the keys of ``cfg.new_keys``, signed by the old root key and the new one, and re-sign
    targets, snapshot and timestamp with the new keys; ValueError (nothing written) when a check fails."""
    from tuf.api.exceptions import UnsignedMetadataError
    from tuf.api.metadata import Metadata

    meta = cfg.repo / "metadata"
    if not (meta / "root.json").is_file():
        raise ValueError(f"{meta / 'root.json'} does not exist: publish to {cfg.repo} before rotating its root")
    if cfg.new_keys.resolve() == cfg.keys.resolve():
        raise ValueError(f"new keys {cfg.new_keys} are the current key directory: rotate to another directory")
    old_key = cfg.keys / "root.key"
    if not old_key.is_file():
        raise ValueError(f"{old_key} does not exist: give the key directory whose root key signs {meta / 'root.json'}")
    old_signer = load_signer(old_key)
    md = {role: _load(meta / f"{role}.json") for role in ROLES}
    old = md["root"]
    version = old.signed.version + 1
    if old_signer.public_key.keyid not in old.signed.roles["root"].keyids:
        raise ValueError(f"{old_key} is not a root key of {meta / 'root.json'} (v{old.signed.version})")
    if (meta / f"{version}.root.json").exists():
        raise ValueError(f"{meta / f'{version}.root.json'} exists but root.json is v{old.signed.version}: "
                         f"not a repository this command keeps")
    new_signers = role_signers(cfg.new_keys)
    if new_signers["root"].public_key.keyid in old.signed.roles["root"].keyids:
        raise ValueError(f"{cfg.new_keys / 'root.key'} is already a root key of {meta / 'root.json'}: "
                         f"a rotation needs a new root key")
    new = Metadata.from_bytes(old.to_bytes())
    root, rotated = new.signed, []
    for role in ROLES:
        key = new_signers[role].public_key
        retired = [k for k in root.roles[role].keyids if k != key.keyid]
        root.add_key(key, role)
        for keyid in retired:
            root.revoke_key(keyid, role)
        if retired:
            rotated.append(role)
    root.version, root.expires = version, expiry(cfg.root_days * 86400)
    new.signatures.clear()
    new.sign(new_signers["root"])
    new.sign(old_signer, append=True)
    try:
        old.verify_delegate("root", new)  # a device trusting root N accepts it
        new.verify_delegate("root", new)  # and it stands alone
    except UnsignedMetadataError as e:
        raise ValueError(f"root v{version} would not meet the root threshold of v{version - 1} and its own: {e}") \
            from None
    md["root"] = new
    resign(md, new_signers, cfg)
    _replace([(new, meta / f"{version}.root.json"), (new, meta / "root.json"),
              *((md[role], meta / f"{role}.json") for role in ("targets", "snapshot", "timestamp"))])
    return Rotated(root_version=version, rotated=rotated, timestamp_version=md["timestamp"].signed.version)


def _load(path: Path):
    """The metadata in ``path``; ValueError naming the file when it is not TUF metadata."""
    from tuf.api.metadata import Metadata
    from tuf.api.serialization import DeserializationError

    try:
        return Metadata.from_file(str(path))
    except DeserializationError as e:
        raise ValueError(f"{path} is not TUF metadata ({' '.join(str(e).split())})") from None


def _replace(files: list) -> None:
    """Stage every (metadata, path) as ``path.tmp``, then rename them in order: a failed write changes nothing."""
    staged = [path.with_name(path.name + ".tmp") for _, path in files]
    try:
        for (md, _), tmp in zip(files, staged):
            tmp.write_bytes(md.to_bytes())
    except OSError:
        for tmp in staged:
            if tmp.is_file():
                tmp.unlink()
        raise
    for (_, path), tmp in zip(files, staged):
        os.replace(tmp, path)
