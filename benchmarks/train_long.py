"""A long training run: does a task keep learning when given time? (Not a timed test.)

Trains ``--task`` for ``--minutes`` of wall time and prints, every ``--eval-every`` iterations, the
environment steps so far, the mean training return, the share of episodes that ran to their end
(for the quadruped: without a fall) and the deterministic evaluation return on fixed seeds,
next to the run's first evaluation. The checkpoint (with its resume state) is written to ``--out``
every ``--checkpoint-every`` iterations; ``--resume OUT/model.pt`` continues a run exactly.
Run: .venv/bin/python benchmarks/train_long.py --task quadruped --minutes 40 [--out DIR] [--resume DIR/model.pt]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from stages.sim.registry import load
from stages.train import TrainConfig, train


class Budget(Exception):
    """The wall-time budget is spent."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="quadruped")
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--envs", type=int, default=256)
    ap.add_argument("--steps-per-env", type=int, default=24)
    ap.add_argument("--hidden", default="256,128,64")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--nthread", type=int, default=1, help="physics threads (torch uses as many)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--resume", type=Path, help="a checkpoint of the same run (same arguments) to continue")
    args = ap.parse_args()
    torch.set_num_threads(args.nthread)
    cfg = TrainConfig(task=args.task, iterations=1_000_000, num_envs=args.envs, steps_per_env=args.steps_per_env,
                      hidden_dims=tuple(int(h) for h in args.hidden.split(",")), entropy_coef=0.01,
                      init_noise_std=1.0, nthread=args.nthread, eval_every=args.eval_every, eval_episodes=32,
                      seed=args.seed, checkpoint_every=args.checkpoint_every)
    start, deadline = time.perf_counter(), time.perf_counter() + 60 * args.minutes
    first: dict[str, float] = {}

    def report(it: int, m: dict[str, float]) -> None:
        if "eval_return" in m:
            first.setdefault("eval_return", m["eval_return"])
            steps = (it + 1) * cfg.num_envs * cfg.steps_per_env
            print(f"it {it + 1:5d}  {steps / 1e6:6.2f} M steps  {(time.perf_counter() - start) / 60:5.1f} min  "
                  f"train return {m['mean_return']:8.2f}  episodes to the end {m['success_rate']:5.2f}  "
                  f"eval return {m['eval_return']:8.2f} (first eval {first['eval_return']:.2f})  "
                  f"sample share {m['sample_time_share']:.2f}", flush=True)
        if not math.isfinite(m["mean_return"]) and it > 5:
            raise RuntimeError(f"iteration {it}: mean return {m['mean_return']}")
        if time.perf_counter() > deadline:
            raise Budget

    print(f"{load(args.task).name}: {cfg.num_envs} envs × {cfg.steps_per_env} steps, hidden {cfg.hidden_dims}, "
          f"{args.minutes:g} min", flush=True)
    out = args.out or Path(tempfile.mkdtemp()) / "ckpt"
    try:
        train(cfg, load(args.task).nominal_params(), out, report, resume=args.resume)
    except Budget:
        pass
    print(f"checkpoint: {out / 'model.pt'} (every {cfg.checkpoint_every} iterations)")


if __name__ == "__main__":
    main()
