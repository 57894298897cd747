"""``sim2edge-agent bench``: latency of ``Policy.act()`` against the bare runtime call, in one run.

Both run on the active bundle's model in the same process, calls interleaved so machine noise
hits both alike; the report gives p50/p99 of each and the ratio act/bare.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import numpy as np

from edge.policy import Policy


def interleaved(fns: Sequence[Callable[[np.ndarray], object]], x: np.ndarray, n: int = 20000,
                warmup: int = 500) -> List[Tuple[float, float]]:
    """(p50, p99) seconds of each function, calls interleaved."""
    for _ in range(warmup):
        for fn in fns:
            fn(x)
    times = np.empty((len(fns), n))
    clock = time.perf_counter
    for i in range(n):
        for j, fn in enumerate(fns):
            start = clock()
            fn(x)
            times[j, i] = clock() - start
    return [(float(np.percentile(t, 50)), float(np.percentile(t, 99))) for t in times]


def bench_policy(policy: Policy, n: int = 20000) -> dict:
    """p50/p99 (µs) of ``policy.act(obs)`` vs ``session.run`` on the same single observation."""
    x = np.random.default_rng(0).normal(size=len(policy.obs_names)).astype(np.float32)
    session, name = policy.runtime.session, policy.runtime.input_name
    (b50, b99), (a50, a99) = interleaved([lambda v: session.run(None, {name: v[None]}), policy.act], x, n)
    m = policy.manifest["policy"]
    return {"policy": m["name"], "version": str(m["version"]), "runtime": policy.runtime.name,
            "providers": policy.runtime.providers, "iterations": n,
            "bare_p50_us": round(b50 * 1e6, 2), "bare_p99_us": round(b99 * 1e6, 2),
            "act_p50_us": round(a50 * 1e6, 2), "act_p99_us": round(a99 * 1e6, 2),
            "ratio_p50": round(a50 / b50, 3), "ratio_p99": round(a99 / b99, 3),
            "period_us": policy.period_s * 1e6}


def bench(root: Path, n: int = 20000) -> dict:
    return bench_policy(Policy.load(root), n)
