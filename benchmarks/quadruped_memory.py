"""Peak RSS of the quadruped task with 256 environments, against 1 environment, in one run.

Each case runs in its own child process (peak RSS is per process and never goes down):
``env``: build a randomized ``BatchedEnv`` and step it ``--steps`` control steps with random actions;
``train``: ``--iterations`` PPO iterations (rollout storage, actor, critic) on the same env count.
Target: peak RSS at 256 envs under 2 GB. The ratio against 1 env says what the envs themselves cost.
Run: .venv/bin/python benchmarks/quadruped_memory.py [--envs 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

LIMIT_MB = 2048


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(case: str, envs: int, steps: int, iterations: int) -> None:
    import numpy as np

    from stages.sim.env import BatchedEnv
    from stages.sim.registry import load

    task = load("quadruped")
    if case == "env":
        env = BatchedEnv(task, envs, randomization=task.randomization, seed=0)
        rng = np.random.default_rng(0)
        for _ in range(steps):
            env.step(rng.uniform(-1, 1, (envs, task.act_dim)))
    else:
        from stages.sim.params import PhysicalParams
        from stages.train import train
        from stages.train_config import TrainConfig

        with tempfile.TemporaryDirectory() as tmp:
            train(TrainConfig(task="quadruped", iterations=iterations, num_envs=envs, steps_per_env=24,
                              hidden_dims=(128, 128)), PhysicalParams(), Path(tmp) / "ck")
    print(json.dumps({"peak_mb": peak_mb()}))


def measure(case: str, envs: int, steps: int, iterations: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", case, "--envs", str(envs), "--steps", str(steps),
                          "--iterations", str(iterations)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--child", choices=("env", "train"))
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.envs, args.steps, args.iterations)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"quadruped peak RSS (commit {commit}, {args.steps} env steps, {args.iterations} PPO iterations)")
    for case in ("env", "train"):
        one = measure(case, 1, args.steps, args.iterations)
        many = measure(case, args.envs, args.steps, args.iterations)
        verdict = "OK" if many < LIMIT_MB else "OVER"
        print(f"  {case:5s}: 1 env {one:7.1f} MB | {args.envs} envs {many:7.1f} MB | ratio {many / one:5.2f} | "
              f"{verdict} (limit {LIMIT_MB} MB)")


if __name__ == "__main__":
    main()
