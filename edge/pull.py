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


def pull(ref: str, registry_url: str, root: Path, trusted: Iterable, skip_target_check: bool = False) -> PullResult:
    """Pull ``policy@alias|version`` into the store at ``root`` and activate it."""
    store = DeviceStore(root)
    client = RegistryClient(registry_url)
    target_ref = client.resolve(ref)
    installed = store.bundle_dir(target_ref.policy, target_ref.version)
    if store.link("current") == installed:
        return PullResult(target_ref.policy, target_ref.version, installed, False, None)
    staging = store.staging_dir()
    try:
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
        shutil.rmtree(staging, ignore_errors=True)
