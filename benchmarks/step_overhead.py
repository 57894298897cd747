"""The Python around the physics in training, this checkout against another one, alternating in one run.

Per checkout (a child process with it on PYTHONPATH), reacher, 64 envs, 2 threads: the CPU µs of one
``RslRlEnv.step`` with ``mujoco.rollout`` stubbed out (observations, rewards, resets, NaN checks, numpy→torch;
best of 3 × 2,000 random actions; CPU time, as it depends less on the machine's load than wall time), env-steps/s
with the physics, and the mean collect, update and iteration seconds of 12 iterations of time_to_threshold.py's
reacher training (the first 2 skipped). With ``--against`` it prints each figure's speed-up of this checkout
(> 1: faster) and the load average, since the wall-clock figures swing with it.
Run: PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py [--against DIR] [--repeats 2]
(DIR: e.g. ``git worktree add /tmp/base <commit>``)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from mujoco import rollout

from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.rsl_env import RslRlEnv
from stages.train import train
from stages.train_config import TrainConfig

REACHER = dict(task="reacher", num_envs=64, steps_per_env=50, learning_rate=3e-3, gamma=0.9, entropy_coef=0.0,
               init_noise_std=0.3, eval_every=0, seed=0)
STEPS = 2000


def measure() -> dict[str, float]:
    """This process's checkout: env-steps/s, Python µs per env step, mean collect/update/iteration seconds."""
    task = load("reacher")
    actions = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (STEPS, REACHER["num_envs"], task.act_dim))
                               .astype(np.float32))

    def seconds(clock: Callable[[], float]) -> float:
        env = RslRlEnv(BatchedEnv(task, REACHER["num_envs"], randomization=task.randomization, seed=0))
        start = clock()
        for a in actions:
            env.step(a)
        return clock() - start

    def hold(self, models, datas, initial_state, control, **kwargs) -> None:
        kwargs["state"][:] = initial_state[:, None]  # no physics: the state stays, episodes still time out

    with mock.patch.object(rollout.Rollout, "rollout", hold):
        python_us = min(1e6 * seconds(time.process_time) / STEPS for _ in range(3))
    phases: dict[str, list[float]] = {"collect_time_s": [], "update_time_s": [], "iteration_time_s": []}

    def on_iteration(it: int, m: dict[str, float]) -> None:
        if it >= 2:
            for k in phases:
                phases[k].append(m[k])

    rate = STEPS * REACHER["num_envs"] / seconds(time.perf_counter)
    with tempfile.TemporaryDirectory() as tmp:
        train(TrainConfig(**{**REACHER, "iterations": 12}), PhysicalParams(), Path(tmp), on_iteration=on_iteration)
    return {"env_steps_per_s": rate, "python_us_per_step": python_us,
            **{k: float(np.mean(v)) for k, v in phases.items()}}


def run(checkout: Path) -> dict[str, float]:
    """:func:`measure` in a child process that imports ``checkout``'s code."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=checkout, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", type=Path, help="another checkout to measure alternately (e.g. the merge-base)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here, **({"other": args.against.resolve()} if args.against else {})}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for repeat in range(args.repeats):
        for name, tree in (trees.items() if repeat % 2 == 0 else reversed(trees.items())):
            results[name].append(r := run(tree))
            shown = "  ".join(f"{k} {v:.4g}" for k, v in r.items())
            print(f"  {name:5s} {shown}  load {os.getloadavg()[0]:.2f}")
    mean = {name: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for name, rs in results.items()}
    for k in mean["this"]:
        line = f"{k:20s} this {mean['this'][k]:10.4g}"
        if "other" in mean:
            ratio = (mean["this"][k] / mean["other"][k] if k == "env_steps_per_s"
                     else mean["other"][k] / mean["this"][k])
            line += f"   other {mean['other'][k]:10.4g}   speed-up {ratio:.2f}×"
        print(line)


if __name__ == "__main__":
    main()
