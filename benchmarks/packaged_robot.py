"""A robot this project did not write, learning with sim2edge's defaults: gymnasium's 7-DoF pusher arm reaching.

The robot is ``examples.gym_pusher:PusherReach``: gymnasium's ``pusher.xml`` loaded from the installed package,
unedited (a fingertip sensor and a target marker added to the parsed spec), the fingertip to reach a random
reachable 3D target in 3 s. Stated target: **≥ 90% of 100 fixed episodes end with the fingertip within 0.1 m of
the target**, the task's success. No published figure exists for this task (gymnasium's ``Pusher-v5`` pushes a
puck with the same arm; its reward is another task's), so the references are measured in the same run:

- sim2edge: rsl_rl PPO with ``TrainConfig``'s defaults (no preset for this task: what a new user gets from
  ``sim2edge run --task examples.gym_pusher:PusherReach``), evaluated every 10 iterations.
- SB3: PPO with Stable-Baselines3's defaults (rl-zoo3 has no hyperparameters for this task either) on the same
  task as a gymnasium env (``TaskEnv``, 8 envs), evaluated every 16,384 env steps, for the same training seconds.
- random: uniform actions, one evaluation.

Both learners are judged by one evaluator: 100 episodes of the batched environment with fixed seeds at the
nominal physics, deterministic action, success as the task defines it. Evaluation time is excluded from
training time. Output: the curves as CSV under ``--out`` and a table of time to the target, final success and
return; the ratio SB3 / sim2edge of the time to the target (">" where a side did not reach it in its budget).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/packaged_robot.py [--minutes 10] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from benchmarks.curve import Curve  # noqa: E402
from stages.sim.env import BatchedEnv  # noqa: E402
from stages.sim.registry import load  # noqa: E402
from stages.train import first_episodes, train  # noqa: E402
from stages.train_config import TrainConfig  # noqa: E402

ROBOT = "examples.gym_pusher:PusherReach"
TARGET_SUCCESS = 0.9
EPISODES = 100
EVAL_SEED = 8_000_000
SIM2EDGE_EVAL_EVERY = 10
SB3_EVAL_EVERY = 16_384

Policy = Callable[[np.ndarray], np.ndarray]
"""(N, obs) observations → (N, act) normalized actions in [-1, 1]."""


def evaluate(policy: Policy) -> tuple[float, float]:
    """(success rate, mean return) of the same ``EPISODES`` seeded episodes, each one's first episode."""
    returns, success = first_episodes(BatchedEnv(load(ROBOT), EPISODES, seed=EVAL_SEED, nthread=2), policy)
    return float(success.mean()), float(returns.mean())


def reached_target(row: tuple) -> bool:
    return row[2] >= TARGET_SUCCESS


def sim2edge(budget_s: float, out: Path) -> Curve:
    """Train with the defaults until the target or ``budget_s``; train's evaluation hook runs the shared evaluator
    (its success rate stands in for the return that ``target_return`` stops at)."""
    defaults = TrainConfig()
    cfg = TrainConfig(task=ROBOT, iterations=100_000, minutes=budget_s / 60, eval_every=SIM2EDGE_EVAL_EVERY,
                      target_return=TARGET_SUCCESS)
    curve = Curve(out / "sim2edge.csv", ("success", "mean_return"), reached_target)
    steps_per_iteration = defaults.num_envs * defaults.steps_per_env

    def evaluate_actor(actor, *_) -> float:
        def policy(obs: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return actor(TensorDict({"policy": torch.from_numpy(obs)}, batch_size=[len(obs)])).numpy()
        return curve.evaluate(steps_per_iteration * SIM2EDGE_EVAL_EVERY * (len(curve.rows) + 1), lambda: evaluate(policy))[0]

    with tempfile.TemporaryDirectory() as tmp:
        curve.start = time.perf_counter()
        train(cfg, load(ROBOT).nominal_params(), Path(tmp) / "ck", evaluate=evaluate_actor)
    return curve


def stable_baselines3(budget_s: float, out: Path) -> Curve:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from stages.sim.gym_env import TaskEnv

    curve = Curve(out / "sb3.csv", ("success", "mean_return"), reached_target)

    class Evaluate(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % SB3_EVAL_EVERY:
                return True
            success, _ = curve.evaluate(self.num_timesteps, lambda: evaluate(
                lambda obs: self.model.predict(obs, deterministic=True)[0]))
            return success < TARGET_SUCCESS and curve.train_s() < budget_s

    env = make_vec_env(lambda: TaskEnv(ROBOT), n_envs=8, seed=0)
    model = PPO("MlpPolicy", env, seed=0, device="cpu")
    curve.start = time.perf_counter()
    model.learn(100_000_000, callback=Evaluate())
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="training budget per learner (default 10)")
    ap.add_argument("--out", type=Path, help="directory for the curves (default: a new temporary directory)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="packaged_robot_"))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    random_success, random_return = evaluate(lambda obs: rng.uniform(-1, 1, (len(obs), load(ROBOT).act_dim)))
    curves = {"sim2edge (defaults)": sim2edge(60 * args.minutes, out), "SB3 PPO (defaults)": stable_baselines3(
        60 * args.minutes, out)}
    print(f"{ROBOT}: time to ≥{TARGET_SUCCESS:.0%} success on {EPISODES} fixed episodes (curves in {out})")
    print(f"  {'learner':22s} {'to target s':>11s} {'env steps':>10s} {'success':>8s} {'return':>8s}")
    print(f"  {'random actions':22s} {'':>11s} {'':>10s} {random_success:8.2f} {random_return:8.2f}")
    for name, c in curves.items():
        t, steps, success, mean_return = c.rows[-1]
        print(f"  {name:22s} {c.shown():>11s} {steps:10,d} {success:8.2f} {mean_return:8.2f}")
    s, b = curves["sim2edge (defaults)"], curves["SB3 PPO (defaults)"]
    if s.crossed:
        print(f"  SB3 / sim2edge time to target: {'' if b.crossed else '>'}{b.reached[0] / s.reached[0]:.1f}x")


if __name__ == "__main__":
    main()
