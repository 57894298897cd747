"""BatchedEnv throughput with the C MuJoCo backend (``mujoco.rollout``, 2 threads) vs MuJoCo Warp on its CPU device.

Both step the same task, env count, randomized per-env physics and random actions in one run; env-steps/s
includes the env's own work (observations, rewards, auto-reset), as training sees it. One untimed step first
(warp compiles its kernels then: ~30 s per task on a cold ``WARP_CACHE_PATH``).
Run: PYTHONPATH=. .venv/bin/python benchmarks/warp_throughput.py [--tasks cartpole,quadruped] [--envs 64,1024,4096]
(needs the ``warp`` extra: ``pip install -e '.[warp]'``)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import warp as wp

from stages.sim.env import BatchedEnv
from stages.sim.registry import load


def rate(task_name: str, n: int, backend: str, env_steps: float) -> float:
    """Env-steps/s of ``BatchedEnv.step`` over about ``env_steps`` environment steps (at least 10 calls)."""
    task = load(task_name)
    env = BatchedEnv(task, n, randomization=task.randomization, seed=0, backend=backend)
    actions = np.random.default_rng(0).uniform(-1, 1, (max(10, int(env_steps // n)), n, task.act_dim))
    env.step(actions[0].astype(np.float32))
    start = time.perf_counter()
    for a in actions.astype(np.float32):
        env.step(a)
    return len(actions) * n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="cartpole,quadruped")
    ap.add_argument("--envs", default="64,1024,4096")
    ap.add_argument("--env-steps", type=float, default=1e5, help="Environment steps timed per measurement.")
    args = ap.parse_args()
    wp.config.quiet = True
    print(f"load average at start: {os.getloadavg()}")
    for name in args.tasks.split(","):
        for n in map(int, args.envs.split(",")):
            c, w = (rate(name, n, backend, args.env_steps) for backend in ("mujoco", "warp"))
            print(f"{name:10s} {n:5d} envs: C MuJoCo {c / 1e3:7.1f} k env-steps/s, Warp (CPU) {w / 1e3:7.1f} k, "
                  f"Warp / C {w / c:.2f}", flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
