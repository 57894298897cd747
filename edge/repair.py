"""Repair: installed copies that no longer verify (storage going bad) are downloaded again.

Every installed bundle except ``current`` is re-verified against the pinned keys; ``previous``
whose directory is gone counts as damaged too. Each damaged copy is fetched again by
``<policy>@<version>`` (the same resolve, download, size bound and extraction as a pull),
verified in staging, and swapped in: the damaged directory is moved into the store's ``tmp/``
(removed there), the fresh one renamed into its place, and the journal says ``repaired``. A
version the registry no longer has, or whose download fails a check, is journaled
``repair-failed`` and left as it was. ``current`` is never touched here (a damaged ``current`` is
the health report's and the operator's business: roll back, or pull another version).

No smoke test: the copy is not activated; ``rollback`` and ``pull`` run the smoke test before
they switch to it. A kill at any step leaves ``current`` as it was; the next repair finishes the
job (a kill between the two renames leaves ``previous`` dangling, which it re-downloads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from edge import bundle, crash
from edge.errors import CheckFailed, RegistryUnavailable
from edge.fetched import check_identity, unpack
from edge.registry_client import RegistryClient, TransferOptions
from edge.store import DeviceStore, fsync_dir

STEPS = ("repair-downloaded", "repair-verified", "repair-moved")  # crash points, in order


@dataclass(frozen=True)
class Damage:
    policy: str
    version: str
    path: Path
    detail: str


@dataclass(frozen=True)
class RepairReport:
    repaired: List[Damage]
    failed: List[str]  # "<policy> v<version>: <why>"


def find_damaged(store: DeviceStore, trusted: Iterable) -> List[Damage]:
    """Installed copies other than ``current`` that fail verification, and a ``previous`` that is gone."""
    trusted = list(trusted)
    current, previous = store.link("current"), store.link("previous")
    found = []
    for policy in store.policies():
        for version in store.installed(policy):
            path = store.bundle_dir(policy, version)
            if path == current:
                continue
            try:
                bundle.verify_dir(path, trusted)
            except (CheckFailed, OSError) as e:
                found.append(Damage(path.parent.name, path.name, path, str(e)[:500]))
    if previous is not None and previous != current and not previous.is_dir():
        found.append(Damage(previous.parent.name, previous.name, previous, "`previous` points at a missing directory"))
    return found


def _fetch(store: DeviceStore, client: RegistryClient, damage: Damage, trusted: list, staging: Path) -> str:
    """Download ``damage``'s version into ``staging/bundle`` and verify it; returns the bundle digest."""
    ref = client.resolve(f"{damage.policy}@{damage.version}")
    part = store.download_part(ref.sha256)
    try:
        client.download(ref, part)
        crash.point("repair-downloaded")
        check_identity(unpack(part, staging / "bundle", ref, trusted), ref)
    finally:
        if part.exists():
            part.unlink()
    crash.point("repair-verified")
    return ref.sha256


def _swap(store: DeviceStore, damage: Damage, staging: Path) -> None:
    """Move the damaged copy out of the way (into staging, deleted with it), the verified one into its place."""
    if damage.path.exists():
        damage.path.chmod(0o700)  # a read-only directory cannot be renamed to another parent
        os.replace(str(damage.path), str(staging / "damaged"))
        fsync_dir(damage.path.parent)
        crash.point("repair-moved")
    store.install(staging / "bundle", damage.policy, damage.version)


def repair(root: Path, registry_url: str, trusted: Iterable, options: Optional[TransferOptions] = None) -> RepairReport:
    """Re-download every damaged installed copy except ``current`` (see the module docstring).

    Raises :class:`RegistryUnavailable` if the registry cannot be reached (nothing changed for the rest)."""
    store, trusted = DeviceStore(root), list(trusted)
    with store.locked():
        damaged = find_damaged(store, trusted)
        if not damaged:
            return RepairReport([], [])
        client = RegistryClient(registry_url, options)
        repaired, failed = [], []
        for damage in damaged:
            staging = store.staging_dir()
            try:
                sha256 = _fetch(store, client, damage, trusted, staging)
                _swap(store, damage, staging)
            except RegistryUnavailable:
                raise
            except CheckFailed as e:
                store.record("repair-failed", policy=damage.policy, version=damage.version, path=str(damage.path),
                             damage=damage.detail, check=e.check, detail=e.detail[:500])
                failed.append(f"{damage.policy} v{damage.version}: {e}")
                continue
            finally:
                store.discard(staging)
            store.record("repaired", policy=damage.policy, version=damage.version, path=str(damage.path),
                         detail=damage.detail, bundle_sha256=sha256)
            repaired.append(damage)
        return RepairReport(repaired, failed)
