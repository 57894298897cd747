"""Message streams onto the task's control ticks.

Rule: an episode's ticks are ``t_k = t_0 + k * period`` from its first joint state ``t_0`` to the tick nearest its
last (at most half a period after it).
Row ``k`` holds the last joint state at or before ``t_k`` and the last command sent before ``t_{k+1}``
(what the controller commanded during period ``k``, after it saw state ``k``: the project's own log rows).
A value older than the stream's staleness limit at its tick, or none at all, makes the episode stale.
"""

from __future__ import annotations

import numpy as np


def episodes(times: np.ndarray, gap_ns: int) -> list[slice]:
    """Runs of ``times`` (sorted, ns) without a gap longer than ``gap_ns``, as index slices."""
    if not len(times):
        return []
    cuts = np.flatnonzero(np.diff(times) > gap_ns) + 1
    return [slice(int(a), int(b)) for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(times)])]


def ticks(first_ns: int, last_ns: int, period_ns: int) -> np.ndarray:
    """The control ticks from ``first_ns`` to the one nearest ``last_ns``."""
    return first_ns + period_ns * np.arange((last_ns - first_ns + period_ns // 2) // period_ns + 1, dtype=np.int64)


def last_before(times: np.ndarray, at: np.ndarray, inclusive: bool) -> np.ndarray:
    """For each of ``at``, the index of the last of ``times`` at (``inclusive``) or before it; -1 if none."""
    return np.searchsorted(times, at, side="right" if inclusive else "left") - 1


def stale(times: np.ndarray, index: np.ndarray, due: np.ndarray, max_age_ns: int) -> np.ndarray:
    """(len(due),) bool: ``index`` is -1 (no value yet) or its time is older than ``max_age_ns`` at ``due``."""
    if not len(times):
        return np.ones(len(due), dtype=bool)
    return (index < 0) | (due - times[np.maximum(index, 0)] > max_age_ns)
