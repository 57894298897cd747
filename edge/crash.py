"""Crash points: where the kill -9 tests stop the agent dead, one named step of install and activation.

``SIM2EDGE_AGENT_KILL_AT=<step>`` makes the agent SIGKILL itself when it reaches ``<step>``
(fault injection for the crash tests; unset in normal use, where this is one dict lookup).
The steps, in order: see :data:`STEPS`.

``SIM2EDGE_AGENT_CORRUPT_AT=<step>:<file>`` instead truncates ``<file>`` of the bundle being
activated to half its length when the agent reaches ``<step>`` (storage that goes bad after the
smoke test; the one such step is ``switched``: ``current`` points at the new bundle, the health
check has not run).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "SIM2EDGE_AGENT_KILL_AT"
CORRUPT_ENV = "SIM2EDGE_AGENT_CORRUPT_AT"
STEPS = (
    "download",           # mid-download: after the first chunk is on disk
    "downloaded",         # the whole bundle is on disk, nothing unpacked
    "extract",            # mid-unpack: after the first member is written
    "verified",           # unpacked and verified in staging
    "smoked",             # smoke test passed, nothing installed
    "install-chmod",      # staged files made read-only, not yet moved into bundles/
    "installed",          # in bundles/<policy>/<version>, not active
    "previous-switched",  # ``previous`` moved to the old current, ``current`` untouched
    "current-link",       # new link written beside ``current``, not yet renamed over it
    "activated",          # ``current`` switched, not yet journaled
    "journaled",          # journaled, staging and the download not yet cleaned up
)


def point(step: str) -> None:
    """SIGKILL this process if the crash tests asked to die at ``step``."""
    if os.environ.get(ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def corrupt(step: str, bundle_dir: Path) -> None:
    """Truncate a file of ``bundle_dir`` if the tests asked to corrupt it at ``step`` (see the module docstring)."""
    at, _, name = os.environ.get(CORRUPT_ENV, "").partition(":")
    if at == step and name:
        target = bundle_dir / name
        target.chmod(0o600)
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
