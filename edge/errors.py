"""The one error type the agent reports: which check failed, and on what."""

import errno


class CheckFailed(Exception):
    """A verification, compatibility or transfer check failed."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""``OSError.errno`` values that mean the device's storage is full: never a property of the bundle."""


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL
