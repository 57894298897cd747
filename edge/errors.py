"""The one error type the agent reports: which check failed, and on what."""


class CheckFailed(Exception):
    """A verification, compatibility or transfer check failed."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail
