"""The errors the agent reports: which check failed, and on what."""

import errno


class CheckFailed(Exception):
    """A verification, compatibility or transfer check failed."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail


class RegistryUnavailable(CheckFailed):
    """The registry could not be reached, or kept failing, after every retry (the caller backs off)."""

    def __init__(self, detail: str, check: str = "registry") -> None:
        super().__init__(check, detail)


class TransferDeadline(RegistryUnavailable):
    """An operation outlived its overall deadline (a stalled or dripping server); counted as unavailable."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, "deadline")


class RegistryError(CheckFailed):
    """The registry answered with an HTTP error that retrying will not fix (``status`` holds the code)."""

    def __init__(self, detail: str, status: int) -> None:
        super().__init__("registry", detail)
        self.status = status


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""``OSError.errno`` values that mean the device's storage is full: never a property of the bundle."""


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL
