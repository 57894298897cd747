"""1,000 reacher episodes across the scenario suite, batched, against a plain single-env loop of the same episodes.

The reference is gymnasium's own ``Reacher-v5``, one environment, one ONNX Runtime call per step,
measured in the same run. Target: the suite in under 60 s on 2 cores.
Run: ``.venv/bin/python benchmarks/evaluate_suite.py``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

from edge.runtime import OnnxRuntime
from stages.sim.params import PhysicalParams
from stages.twin.evaluate import EvalConfig, run_shard, shard_jobs
from tests.bundles import linear_onnx

EPISODES = 1000


def main() -> None:
    onnx = Path(tempfile.mkdtemp()) / "p.onnx"
    onnx.write_bytes(linear_onnx(np.random.default_rng(0).normal(0, 0.3, (10, 2))))
    cfg = EvalConfig(video=False)
    suite = cfg.load_suite("reacher")
    suite = suite.model_copy(update={"episodes": EPISODES // len(suite.scenarios)})
    start = time.perf_counter()
    shards = [run_shard(job, "reacher", PhysicalParams()) for job in shard_jobs(cfg, suite, onnx)]
    batched = time.perf_counter() - start
    n = sum(len(s.returns) for s in shards)

    policy, env = OnnxRuntime(onnx), gym.make("Reacher-v5")
    start = time.perf_counter()
    for ep in range(n):
        obs, _ = env.reset(seed=ep)
        done = False
        while not done:
            action = policy.run(obs.astype(np.float32)[None])[0]
            obs, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
    plain = time.perf_counter() - start
    print(f"{n} reacher episodes over {len(suite.scenarios)} scenarios: batched suite {batched:.1f} s "
          f"(target < 60 s), plain single-env gymnasium loop {plain:.1f} s; ratio {plain / batched:.2f}x faster")


if __name__ == "__main__":
    main()
