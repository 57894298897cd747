"""Prefect artifact keys from names users choose (tasks, policies)."""

from __future__ import annotations

import re


def artifact_key(prefix: str, name: str) -> str:
    """``prefix-name`` as Prefect takes an artifact key: lowercase letters, digits and dashes (``pusher_reach`` →
    ``pusher-reach``)."""
    return f"{prefix}-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}"
