"""A bundle as the registry named it: authenticated before it is unpacked, then checked to be the policy
version that was asked for. Shared by ``pull`` and ``repair``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from edge import bundle
from edge.errors import CheckFailed
from edge.registry_answers import BundleRef


def unpack(part: Path, dest: Path, ref: BundleRef, trusted: Iterable) -> dict:
    """Authenticate the downloaded bundle ``part``, then extract its signed files into a new ``dest``
    (bounded by the size the registry declared); returns its manifest."""
    dest.mkdir()
    return bundle.extract(part, dest, max_bytes=4 * ref.size + (1 << 20), trusted=trusted)


def check_identity(manifest: dict, ref: BundleRef) -> None:
    """The bundle must be the policy version the registry said it is."""
    if (manifest["policy"]["name"], str(manifest["policy"]["version"])) != (ref.policy, ref.version):
        raise CheckFailed("manifest", f"bundle is {manifest['policy']['name']} v{manifest['policy']['version']}, "
                                      f"registry said {ref.policy} v{ref.version}")
