"""Install a bundle file into a device store at image build time, with the agent's own checks.

``python3 install_bundle.py BUNDLE --trust PUB --root STORE``: unpack safely, verify signature and
files, check the target against this image's L4T (``L4T_VERSION``), install read-only, activate.
The smoke test runs in the container (HEALTHCHECK), on the device's runtime, not at build time.
"""

import argparse
import sys
from pathlib import Path

from edge import bundle, signing
from edge.errors import CheckFailed
from edge.store import DeviceStore
from edge.targets import check_compatible, detect_device, load_target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--trust", type=Path, required=True)
    p.add_argument("--root", type=Path, required=True)
    args = p.parse_args()
    store = DeviceStore(args.root)
    try:
        with store.locked():
            staged = store.staging_dir()
            manifest = bundle.extract(args.bundle, staged, max_bytes=4 * args.bundle.stat().st_size + (1 << 20),
                                      trusted=signing.load_trusted([args.trust]))  # authenticated before unpacked
            check_compatible(load_target(manifest["target"]["name"]), detect_device())
            policy, version = manifest["policy"]["name"], str(manifest["policy"]["version"])
            store.activate(store.install(staged, policy, version))
            store.record("activate", policy=policy, version=version, source=f"image build ({args.bundle.name})")
    except (CheckFailed, OSError, ValueError, KeyError) as e:
        print(f"install_bundle: {e}", file=sys.stderr)
        return 2
    print(f"installed {policy} v{version} for {manifest['target']['name']} in {args.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
