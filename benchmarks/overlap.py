"""Does collecting the next rollout during the update (``TrainConfig.overlap``) pay on this machine?

Trains the same reacher run (time_to_threshold.py's hyperparameters, torch on 1 thread) with and
without overlap, alternating, and prints the mean iteration wall time of each, their ratio, and the
deterministic evaluation returns (the overlapped run learns from data one policy old).
Run: .venv/bin/python benchmarks/overlap.py [--task reacher] [--iterations 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from stages.sim.registry import load
from stages.train import TrainConfig, train

REACHER = dict(num_envs=64, steps_per_env=50, learning_rate=3e-3, gamma=0.9, entropy_coef=0.0, init_noise_std=0.3)


def run(cfg: TrainConfig) -> tuple[float, float, float, list[float]]:
    """Mean collect, update and iteration seconds (first two iterations skipped), and the evaluation returns."""
    ms: list[dict[str, float]] = []
    train(cfg, load(cfg.task).nominal_params(), Path(tempfile.mkdtemp()) / "ck", lambda it, m: ms.append(m))
    mean = lambda k: float(np.mean([m[k] for m in ms[2:]]))  # noqa: E731
    return mean("collect_time_s"), mean("update_time_s"), mean("iteration_time_s"), \
        [round(m["eval_return"], 1) for m in ms if "eval_return" in m]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="reacher")
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = TrainConfig(task=args.task, iterations=args.iterations, eval_every=10, eval_episodes=16,
                       **(REACHER if args.task == "reacher" else {}))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in (False, True):
            collect, update, iteration, evals = run(base.model_copy(update={"overlap": overlap}))
            times[overlap].append(iteration)
            print(f"overlap={overlap!s:5}  collect {collect * 1e3:6.1f} ms  update {update * 1e3:6.1f} ms  "
                  f"iteration {iteration * 1e3:6.1f} ms  eval returns {evals}", flush=True)
    sequential, overlapped = np.mean(times[False]), np.mean(times[True])
    print(f"iteration time sequential/overlapped: {sequential / overlapped:.2f}x "
          f"({sequential * 1e3:.1f} ms vs {overlapped * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
