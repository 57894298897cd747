"""Wall time until the deterministic return on reacher reaches −6: sim2edge vs Stable-Baselines3.

Both sides run in this process, two seeds each, with torch on one thread. Evaluation (16 seeded
episodes, deterministic action) is not counted in either side's wall time.

- sim2edge: rsl_rl PPO on the batched ``reacher`` task (gymnasium's Reacher-v5 model, observation,
  reward and episode length), 64 environments on 2 physics threads.
- reference: SB3 PPO with rl-zoo3's tuned ``Reacher`` hyperparameters (hyperparams/ppo.yml:
  one env, VecNormalize, n_steps 512, batch 32, γ 0.9, ...) on gymnasium's ``Reacher-v5``.

Run: ``.venv/bin/python benchmarks/time_to_threshold.py`` (needs ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from stages.sim.params import PhysicalParams  # noqa: E402
from stages.train import TrainConfig, train  # noqa: E402

THRESHOLD = -6.0
EVAL_EPISODES = 16
SEEDS = (0, 1)
BUDGET_S = 600.0
"""A side that has not reached the threshold after this much training time is reported as '>'."""

SIM2EDGE = dict(task="reacher", iterations=1000, num_envs=64, steps_per_env=50, learning_rate=3e-3, gamma=0.9,
                entropy_coef=0.0,
                init_noise_std=0.3, eval_every=2, eval_episodes=EVAL_EPISODES, target_return=THRESHOLD)
RL_ZOO_REACHER = dict(batch_size=32, n_steps=512, gamma=0.9, learning_rate=0.000104019, ent_coef=7.52585e-08,
                      clip_range=0.3, n_epochs=5, gae_lambda=1.0, max_grad_norm=0.9, vf_coef=0.950368)


def sim2edge(seed: int) -> tuple[float, int]:
    """Training seconds (evaluation excluded) and env steps until the threshold."""
    evals, done = [0.0], [None]
    start = time.perf_counter()

    def on_iteration(it: int, m: dict[str, float]) -> None:
        evals[0] += m.get("eval_time_s", 0.0)
        if m.get("eval_return", -np.inf) >= THRESHOLD:
            done[0] = it + 1
        if time.perf_counter() - start - evals[0] > BUDGET_S:
            raise TimeoutError

    with tempfile.TemporaryDirectory() as tmp:
        try:
            train(TrainConfig(seed=seed, **SIM2EDGE), PhysicalParams(), Path(tmp) / "ck", on_iteration=on_iteration)
        except TimeoutError:
            return float("inf"), 0
    wall = time.perf_counter() - start - evals[0]
    return (wall, done[0] * SIM2EDGE["num_envs"] * SIM2EDGE["steps_per_env"]) if done[0] else (float("inf"), 0)


def stable_baselines3(seed: int) -> tuple[float, int]:
    """The same for SB3 PPO (rl-zoo3 tuned) on Reacher-v5, evaluated every 2,048 steps."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = VecNormalize(make_vec_env("Reacher-v5", n_envs=1, seed=seed))
    evaluator = gym.make("Reacher-v5")

    class UntilThreshold(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.start, self.evals, self.reached = time.perf_counter(), 0.0, None

        def _on_step(self) -> bool:
            if self.num_timesteps % 2048:
                return True
            t = time.perf_counter()
            returns = []
            for episode in range(EVAL_EPISODES):
                obs, _ = evaluator.reset(seed=7_000_000 + episode)
                total, over = 0.0, False
                while not over:
                    action, _ = self.model.predict(env.normalize_obs(obs), deterministic=True)
                    obs, reward, terminated, truncated, _ = evaluator.step(action)
                    total, over = total + reward, terminated or truncated
                returns.append(total)
            self.evals += time.perf_counter() - t
            if np.mean(returns) >= THRESHOLD:
                self.reached = time.perf_counter() - self.start - self.evals
                return False
            return time.perf_counter() - self.start - self.evals < BUDGET_S

    cb = UntilThreshold()
    PPO("MlpPolicy", env, seed=seed, device="cpu", **RL_ZOO_REACHER).learn(10_000_000, callback=cb)
    return (cb.reached, cb.num_timesteps) if cb.reached else (float("inf"), 0)


def main() -> None:
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"reacher time to deterministic return ≥ {THRESHOLD} ({EVAL_EPISODES} episodes), commit {commit}")
    ours, theirs = [], []
    for seed in SEEDS:
        ours.append(sim2edge(seed))
        print(f"  sim2edge  seed {seed}: {ours[-1][0]:7.1f} s, {ours[-1][1]:>8,} env steps", flush=True)
        theirs.append(stable_baselines3(seed))
        print(f"  SB3 PPO   seed {seed}: {theirs[-1][0]:7.1f} s, {theirs[-1][1]:>8,} env steps", flush=True)
    a, b = np.mean([t for t, _ in ours]), np.mean([t for t, _ in theirs])
    print(f"mean: sim2edge {a:.1f} s, SB3 {b:.1f} s → sim2edge is {b / a:.1f}× faster (target ≥ 5×)")


if __name__ == "__main__":
    main()
