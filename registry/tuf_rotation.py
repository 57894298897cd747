"""Root key rotation of a repository written by registry/tuf_repo.py (TUF specification 5.3.4, python-tuf's
Metadata API).

:func:`rotate_root` writes root version N+1 whose four roles name the keys and thresholds in ``new_keys`` (a key
directory of the same layout, its keys made on first use; a key file there that is a copy of an old one keeps that
key, so a multi-key root can replace one key; at least one root key must be new), signed by the old root keys present (at least root N's threshold), so that a device trusting root N
accepts it, and by every new one, so that it verifies on its own as the next trust anchor. Targets, snapshot and
timestamp are then re-signed with the new keys, their versions bumped. Devices walk the chain themselves: ngclient
fetches ``metadata/<N+1>.root.json`` on its next refresh, checks it against both roots, and from then on accepts
only what the new keys sign. The old key directory then signs nothing a device accepts: retire it, and publish with
``--keys NEW``.

Nothing is written before every file is signed and verified; the five files are then staged as ``*.tmp`` and
renamed over the old ones (``<N+1>.root.json`` and ``root.json`` first, timestamp last), so a refused rotation
leaves the repository as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from registry.tuf_repo import ROLES, RepoConfig, enough, expiry, key_layout, resign, role_signers, sign_all


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
    """Write root v N+1 with the keys and thresholds of ``cfg.new_keys``, signed by the old root keys and the new
    ones, and re-sign targets, snapshot and timestamp with the new keys; ValueError (nothing written) when a check
    fails."""
    from tuf.api.exceptions import UnsignedMetadataError
    from tuf.api.metadata import Metadata

    meta = cfg.repo / "metadata"
    if not (meta / "root.json").is_file():
        raise ValueError(f"{meta / 'root.json'} does not exist: publish to {cfg.repo} before rotating its root")
    if cfg.new_keys.resolve() == cfg.keys.resolve():
        raise ValueError(f"new keys {cfg.new_keys} are the current key directory: rotate to another directory")
    old_signers = role_signers(cfg.keys, create=False)["root"]
    if not old_signers:
        raise ValueError(f"{cfg.keys / 'root.key'} does not exist: give the key directory whose root keys sign "
                         f"{meta / 'root.json'}")
    md = {role: _load(meta / f"{role}.json") for role in ROLES}
    old = md["root"]
    version = old.signed.version + 1
    old_signers = enough(old.signed, "root", old_signers, f"{cfg.keys} holds", meta / "root.json")
    if (meta / f"{version}.root.json").exists():
        raise ValueError(f"{meta / f'{version}.root.json'} exists but root.json is v{old.signed.version}: "
                         f"not a repository this command keeps")
    new_signers = role_signers(cfg.new_keys)
    if {s.public_key.keyid for s in new_signers["root"]} <= set(old.signed.roles["root"].keyids):
        raise ValueError(f"every root key in {cfg.new_keys} is already a root key of {meta / 'root.json'}: "
                         f"a rotation needs a new root key")
    new = Metadata.from_bytes(old.to_bytes())
    root, rotated = new.signed, []
    for role, layout in key_layout(cfg.new_keys).items():
        keys = {s.public_key.keyid: s.public_key for s in new_signers[role]}
        retired = [k for k in root.roles[role].keyids if k not in keys]
        for key in keys.values():
            root.add_key(key, role)
        for keyid in retired:
            root.revoke_key(keyid, role)
        root.roles[role].threshold = layout.threshold
        if retired:
            rotated.append(role)
    root.version, root.expires = version, expiry(cfg.root_days * 86400)
    sign_all(new, new_signers["root"])
    for signer in old_signers:
        new.sign(signer, append=True)
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
