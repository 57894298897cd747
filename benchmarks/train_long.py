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

import numpy as np
from tensordict import TensorDict

from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.sim.task import Task
from stages.train import EVAL_SEED, load_actor, train
from stages.train_config import TrainConfig


class Budget(Exception):
    """The wall-time budget is spent."""


def velocity_tracking(actor: torch.nn.Module | None, task: Task, episodes: int = 32) -> tuple[float, float, float]:
    """Legged tasks: mean |commanded − actual| body-frame planar velocity (m/s) and yaw rate (rad/s) over the
    steps before a fall, and the share of episodes that fell, with the deterministic policy (None: stand still)."""
    env = BatchedEnv(task, episodes, params=task.nominal_params(), seed=EVAL_SEED, terminate=False)
    alive, lin_err, yaw_err = np.ones(episodes, bool), [], []
    obs = env.observe()
    with torch.inference_mode():
        for _ in range(task.episode_steps - 1):
            action = (np.zeros((episodes, task.act_dim), np.float32) if actor is None else
                      actor(TensorDict({"policy": torch.from_numpy(obs)}, batch_size=[episodes])).clamp(-1, 1).numpy())
            command = env.command.copy()  # the one in force during this step
            r = env.step(action)
            alive &= ~task.terminated(env.qpos, env.qvel, **env.inputs())
            lin, ang, _ = task.base(env.qpos, env.qvel)
            lin_err.append(np.linalg.norm(command[:, :2] - lin[:, :2], axis=1)[alive])
            yaw_err.append(np.abs(command[:, 2] - ang[:, 2])[alive])
            obs = r.obs
    return float(np.concatenate(lin_err).mean()), float(np.concatenate(yaw_err).mean()), float(1 - alive.mean())


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
    task = load(args.task)
    if hasattr(task, "base") and (out / "model.pt").exists():
        for name, actor in (("standing still", None), ("trained policy", load_actor(out / "model.pt"))):
            lin, yaw, fell = velocity_tracking(actor, task)
            print(f"velocity tracking, {name:14s}: |v_xy error| {lin:.3f} m/s, |yaw-rate error| {yaw:.3f} rad/s, "
                  f"fell in {fell:.0%} of 32 episodes", flush=True)


if __name__ == "__main__":
    main()
