"""Crash points: where the kill -9 tests stop the agent dead, one named step of install and activation.

``SIM2EDGE_AGENT_KILL_AT=<step>`` makes the agent SIGKILL itself when it reaches ``<step>``
(fault injection for the crash tests; unset in normal use, where this is one dict lookup).
The steps, in order: see :data:`STEPS`.
"""

from __future__ import annotations

import os
import signal

ENV = "SIM2EDGE_AGENT_KILL_AT"
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
