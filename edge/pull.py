"""Pull: resolve → download → unpack → verify → target check → smoke test → install → activate.

Every step before the switch works in a staging directory of the store; any failure
removes it and leaves ``current`` as it was.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from edge import bundle
from edge.errors import CheckFailed
from edge.registry_client import RegistryClient
from edge.smoke import SmokeResult, smoke_test
from edge.store import DeviceStore
from edge.targets import check_compatible, detect_device, load_target


@dataclass(frozen=True)
class PullResult:
    policy: str
    version: str
    path: Path
    changed: bool
    smoke: Optional[SmokeResult]


def check_fresh(active: Optional[dict], policy: str, version: str) -> None:
    """Refuse a version older than the active one (rollback attacks); rollback is its own command."""
    if active and active["policy"]["name"] == policy and int(version) < int(active["policy"]["version"]):
        raise CheckFailed("freshness", f"{policy} v{version} is older than the active v{active['policy']['version']}; "
                                       f"use `sim2edge-agent rollback` to go back on purpose")


def rollback(root: Path, trusted: Iterable, version: Optional[str] = None) -> Path:
    """Re-verify an installed bundle (``previous`` by default) and make it current."""
    store = DeviceStore(root)
    current = store.link("current")
    if version is None:
        target = store.link("previous")
        if target is None:
            raise CheckFailed("rollback", "there is no previous policy to roll back to")
    else:
        if current is None:
            raise CheckFailed("rollback", "no active policy")
        target = store.bundle_dir(current.parent.name, version)
        if not target.is_dir():
            raise CheckFailed("rollback", f"{current.parent.name} v{version} is not installed "
                                          f"(installed: {', '.join(store.installed(current.parent.name))})")
    manifest = bundle.verify_dir(target, trusted)
    smoke_test(target, manifest)
    store.activate(target)
    store.record("rollback", policy=manifest["policy"]["name"], version=str(manifest["policy"]["version"]),
                 from_path=str(current) if current else None)
    return target


def pull(ref: str, registry_url: str, root: Path, trusted: Iterable, skip_target_check: bool = False) -> PullResult:
    """Pull ``policy@alias|version`` into the store at ``root`` and activate it."""
    store = DeviceStore(root)
    client = RegistryClient(registry_url)
    target_ref = client.resolve(ref)
    installed = store.bundle_dir(target_ref.policy, target_ref.version)
    if store.link("current") == installed:
        return PullResult(target_ref.policy, target_ref.version, installed, False, None)
    staging = None
    try:
        check_fresh(store.current_manifest(), target_ref.policy, target_ref.version)
        staging = store.staging_dir()
        tar_path = staging / "bundle.tar"
        client.download(target_ref, tar_path)
        unpacked = staging / "bundle"
        unpacked.mkdir()
        bundle.extract(tar_path, unpacked, max_bytes=4 * target_ref.size + (1 << 20))
        manifest = bundle.verify_dir(unpacked, trusted)
        if (manifest["policy"]["name"], str(manifest["policy"]["version"])) != (target_ref.policy, target_ref.version):
            raise CheckFailed("manifest", f"bundle is {manifest['policy']['name']} v{manifest['policy']['version']}, "
                                          f"registry said {target_ref.policy} v{target_ref.version}")
        if not skip_target_check:
            check_compatible(load_target(manifest["target"]["name"]), detect_device())
        smoke = smoke_test(unpacked, manifest)
        final = store.install(unpacked, target_ref.policy, target_ref.version)
        store.activate(final)
        store.record("activate", policy=target_ref.policy, version=target_ref.version, source=registry_url,
                     run_id=target_ref.run_id, bundle_sha256=target_ref.sha256, smoke_p99_s=smoke.latency_p99_s,
                     target_check=not skip_target_check)
        return PullResult(target_ref.policy, target_ref.version, final, True, smoke)
    except CheckFailed as e:
        store.record("refused", ref=ref, check=e.check, detail=e.detail)
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
