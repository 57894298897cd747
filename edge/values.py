"""Values that cross a trust boundary, parsed once where they enter the agent.

Registry answers, tags, manifests and command-line references become these types before any
use; everything past the boundary takes the typed value. Each parser raises
:class:`~edge.errors.CheckFailed` naming the check, the field and the offending value (shortened),
never anything else, whatever it is given.

- :class:`PolicyName`: 1–128 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit (one path
  component: never ``.``/``..``, never a separator).
- :class:`Version`: a positive decimal integer of at most 18 ASCII digits, no sign, no leading zero
  (MLflow's model version numbers).
- :class:`Sha256`: exactly 64 lowercase hex digits.
- :func:`byte_count`: a non-negative decimal integer within a limit.
- :class:`ArtifactPath`: a relative, normalized ``/``-separated path of plain components, as the
  artifact proxy serves it (never absolute, no ``..``, no empty component, no backslash).
"""

from __future__ import annotations

import re
from typing import Optional

from edge.errors import CheckFailed

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION = re.compile(r"[1-9][0-9]{0,17}")
"""A version number's text (see :class:`Version`)."""
ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""An MLflow run or experiment id."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COUNT = re.compile(r"[0-9]{1,18}")
_PATH_PART = re.compile(r"[A-Za-z0-9_+=@,~-][A-Za-z0-9._+=@,~-]{0,254}")
MAX_PATH = 1024


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for one-line messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _text(value: object, check: str, field: str) -> str:
    if not isinstance(value, str):
        raise CheckFailed(check, f"{field} must be a string, got {type(value).__name__} {shown(value)}")
    return value


class PolicyName(str):
    """A policy (registered model) name that is safe as one path component."""

    @classmethod
    def parse(cls, value: object, field: str = "policy name", check: str = "registry") -> "PolicyName":
        text = _text(value, check, field)
        if not _NAME.fullmatch(text):
            raise CheckFailed(check, f"{field} {shown(text)} is not a policy name (1-128 of A-Z a-z 0-9 . _ -, "
                                     f"starting with a letter or digit)")
        return cls(text)


class Version(str):
    """A model version number, kept as its decimal text (``int(v)`` orders versions)."""

    @classmethod
    def parse(cls, value: object, field: str = "version", check: str = "registry") -> "Version":
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        text = _text(value, check, field)
        if not VERSION.fullmatch(text):
            raise CheckFailed(check, f"{field} {shown(text)} is not a positive version number")
        return cls(text)


class Sha256(str):
    """A sha256 digest in lowercase hex."""

    @classmethod
    def parse(cls, value: object, field: str = "sha256", check: str = "registry") -> "Sha256":
        text = _text(value, check, field)
        if not _SHA256.fullmatch(text):
            raise CheckFailed(check, f"{field} {shown(text)} is not a sha256 digest (64 lowercase hex digits)")
        return cls(text)


def byte_count(value: object, field: str, limit: Optional[int] = None, check: str = "registry") -> int:
    """A non-negative byte count given as an int or decimal text, at most ``limit``."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = _text(value, check, field)
    if not _COUNT.fullmatch(text):
        raise CheckFailed(check, f"{field} {shown(text)} is not a non-negative byte count")
    count = int(text)
    if limit is not None and count > limit:
        raise CheckFailed("size", f"{field} declares {count} bytes, over this device's limit of {limit} bytes")
    return count


class ArtifactPath(str):
    """A path under the registry's artifact proxy root: relative and normalized."""

    @classmethod
    def parse(cls, value: object, field: str = "artifact path", check: str = "registry") -> "ArtifactPath":
        text = _text(value, check, field)
        parts = text.split("/")
        if not text or len(text) > MAX_PATH or not all(_PATH_PART.fullmatch(p) for p in parts):
            raise CheckFailed(check, f"{field} {shown(text)} is not a relative, normalized artifact path "
                                     f"(no leading '/', no '..', '.' or empty parts, plain characters only)")
        return cls(text)
