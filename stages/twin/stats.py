"""Confidence intervals for evaluation metrics (written here: two short formulas, no library needed)."""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean(values: np.ndarray, seed: int = 0, resamples: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean, seeded."""
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(resamples, len(values)), replace=True).mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def metric_intervals(values: dict[str, np.ndarray], seed: int = 0) -> dict[str, dict]:
    """{name: {"mean", "ci95"}} of per-episode task metrics (``Task.metrics``), each with a bootstrap interval."""
    return {name: {"mean": float(np.mean(v)), "ci95": list(bootstrap_mean(np.asarray(v, dtype=float), seed=seed))}
            for name, v in values.items()}
