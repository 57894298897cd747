"""Does collecting the next rollout during the update (``TrainConfig.collector``) pay on this machine?

Trains the same reacher run (time_to_threshold.py's hyperparameters, torch on 1 thread) with each collector
(``sequential``; ``thread``: a second thread, the GIL shared; ``process``: a spawned child process),
alternating, and prints the mean iteration wall time of each, its ratio to sequential, the deterministic
evaluation returns (thread and process learn from data one policy old) and the load average.
Run: .venv/bin/python benchmarks/overlap.py [--task reacher] [--iterations 60] [--repeats 2]
     [--collectors sequential,thread,process]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stages.sim.registry import load
from stages.train import train
from stages.train_config import TrainConfig

REACHER = dict(num_envs=64, steps_per_env=50, learning_rate=3e-3, gamma=0.9, entropy_coef=0.0, init_noise_std=0.3)


def run(cfg: TrainConfig) -> tuple[float, float, float, float, list[float]]:
    """Mean collect, update and iteration seconds (first two iterations skipped), the whole run's wall seconds
    (the child's start and the evaluations included), and the evaluation returns."""
    ms: list[dict[str, float]] = []
    start = time.perf_counter()
    train(cfg, load(cfg.task).nominal_params(), Path(tempfile.mkdtemp()) / "ck", lambda it, m: ms.append(m))
    wall = time.perf_counter() - start
    mean = lambda k: float(np.mean([m[k] for m in ms[2:]]))  # noqa: E731
    return mean("collect_time_s"), mean("update_time_s"), mean("iteration_time_s"), wall, \
        [round(m["eval_return"], 1) for m in ms if "eval_return" in m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="reacher")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--collectors", default="sequential,thread,process")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = TrainConfig(task=args.task, iterations=args.iterations, eval_every=10, eval_episodes=16,
                       **(REACHER if args.task == "reacher" else {}))
    collectors = args.collectors.split(",")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    times: dict[str, list[float]] = {c: [] for c in collectors}
    walls: dict[str, list[float]] = {c: [] for c in collectors}
    for _ in range(args.repeats):
        for collector in collectors:
            collect, update, iteration, wall, evals = run(base.model_copy(update={"collector": collector}))
            times[collector].append(iteration)
            walls[collector].append(wall)
            print(f"{collector:10}  collect {collect * 1e3:6.1f} ms  update {update * 1e3:6.1f} ms  "
                  f"iteration {iteration * 1e3:6.1f} ms  run {wall:5.1f} s  eval returns {evals}", flush=True)
    print(f"load average at end: {os.getloadavg()}")
    first = collectors[0]
    for collector in collectors[1:]:
        runs = ", ".join(f"{a / b:.2f}x" for a, b in zip(times[first], times[collector]))
        print(f"{first}/{collector}: iteration time {np.mean(times[first]) / np.mean(times[collector]):.2f}x "
              f"({np.mean(times[first]) * 1e3:.1f} vs {np.mean(times[collector]) * 1e3:.1f} ms; runs {runs}), "
              f"whole run {np.mean(walls[first]) / np.mean(walls[collector]):.2f}x")


if __name__ == "__main__":
    main()
