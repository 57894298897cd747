"""Wall time until the deterministic return on reacher reaches −6: sim2edge vs Stable-Baselines3 vs the physics floor.

All three run in this process, one seed after another, torch on one thread, so every ratio compares
times measured under the same machine load.

- sim2edge: rsl_rl PPO on the batched ``reacher`` task (gymnasium's Reacher-v5 model, observation,
  reward and episode length), 64 environments on 2 physics threads.
- SB3: PPO with rl-zoo3's tuned ``Reacher`` hyperparameters (hyperparams/ppo.yml: one env,
  VecNormalize, n_steps 512, batch 32, γ 0.9, ...) on gymnasium's ``Reacher-v5``.
- floor: ``mujoco.rollout`` alone (64 reacher models, 2 threads, 2 physics substeps per env step, one
  call per env step as a policy in the loop needs, random controls) for as many env steps as sim2edge
  consumed up to its crossing, measured right after that sim2edge run. No observation, reward,
  policy or learning: what no trainer on this physics can beat.

Evaluation: both sides are judged by one evaluator, gymnasium's own ``Reacher-v5`` (the task SB3 trains
on and the −6 refers to, so sim2edge gets no home advantage), as a ``SyncVectorEnv`` of 100 envs reset
with seeds 7,000,000 … 7,000,099: the same 100 episodes every time for both sides, deterministic
action. Batching the 100 episodes (50 steps, one policy call per step for all of them) makes a 100-episode
evaluation cheap enough to run at every checkpoint: sim2edge every 2 iterations (6,400 env steps), SB3
every 2,048 env steps. Evaluation time is excluded from both sides' training time.

Output: per side and seed a CSV of every evaluation (``train_s,env_steps,eval_return``) under ``--out``
(default: a new temporary directory, printed), and a table of times, env steps and the ratios
SB3 / sim2edge (target ≥ 20×) and sim2edge / floor (target ≤ 3×). ``--quick``: one seed, 5 s per side
(a smoke test; a side that has not crossed is shown as ">"). ``--breakdown``: where sim2edge's training
time goes (physics, env Python, policy inference, rollout storage, PPO update) on a short run with timers.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/time_to_threshold.py [--quick] [--out DIR] [--breakdown]``
(needs ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("MUJOCO_GL", "egl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mujoco import rollout  # noqa: E402
from tensordict import TensorDict  # noqa: E402

import stages.rsl_env  # noqa: E402
from benchmarks.curve import Curve  # noqa: E402
from stages.sim.env import STATE_SPEC  # noqa: E402
from stages.sim.params import PhysicalParams  # noqa: E402
from stages.sim.registry import load  # noqa: E402
from stages.train import train  # noqa: E402
from stages.train_config import TrainConfig  # noqa: E402

THRESHOLD = -6.0
EVAL_EPISODES = 100
EVAL_SEED = 7_000_000
SB3_EVAL_EVERY = 2048

SIM2EDGE = dict(task="reacher", iterations=1000, num_envs=64, steps_per_env=50, learning_rate=3e-3, gamma=0.9,
                entropy_coef=0.0, init_noise_std=0.3, eval_every=2, eval_episodes=EVAL_EPISODES,
                target_return=THRESHOLD)
RL_ZOO_REACHER = dict(batch_size=32, n_steps=512, gamma=0.9, learning_rate=0.000104019, ent_coef=7.52585e-08,
                      clip_range=0.3, n_epochs=5, gae_lambda=1.0, max_grad_norm=0.9, vf_coef=0.950368)


def crossed_threshold(row: tuple) -> bool:
    return row[2] >= THRESHOLD


class Evaluator:
    """Mean return of the same 100 seeded ``Reacher-v5`` episodes under a batched deterministic policy."""

    def __init__(self) -> None:
        self.envs = gym.vector.SyncVectorEnv([lambda: gym.make("Reacher-v5")] * EVAL_EPISODES)
        self.steps = load("reacher").episode_steps

    def __call__(self, policy) -> float:
        """``policy``: (N, 10) observations → (N, 2) actuator controls."""
        obs, _ = self.envs.reset(seed=EVAL_SEED)
        total = np.zeros(EVAL_EPISODES)
        for _ in range(self.steps):
            obs, reward, terminated, truncated, _ = self.envs.step(policy(obs))
            total += reward
        assert truncated.all() and not terminated.any(), "Reacher-v5 episodes last exactly 50 steps"
        return float(total.mean())


def sim2edge(seed: int, budget_s: float, evaluator: Evaluator, out: Path) -> Curve:
    """Train until the threshold or ``budget_s`` training seconds; train's own evaluation hook (its time
    reported as ``eval_time_s`` and subtracted) runs the shared evaluator."""
    task = load("reacher")
    curve = Curve(out / f"sim2edge_seed{seed}.csv", ("eval_return",), crossed_threshold)

    def evaluate(actor, *_) -> float:
        def policy(obs: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                a = actor(TensorDict({"policy": torch.from_numpy(obs.astype(np.float32))}, batch_size=[len(obs)]))
            return task.action_default + task.action_scale * a.clamp(-1.0, 1.0).numpy()
        return evaluator(policy)

    def on_iteration(it: int, m: dict[str, float]) -> None:
        curve.eval_s += m.get("eval_time_s", 0.0)
        if "eval_return" in m:
            curve.add(curve.train_s(), (it + 1) * SIM2EDGE["num_envs"] * SIM2EDGE["steps_per_env"], m["eval_return"])
        if curve.train_s() > budget_s:
            raise TimeoutError

    with tempfile.TemporaryDirectory() as tmp:
        curve.start = time.perf_counter()
        try:
            train(TrainConfig(seed=seed, **SIM2EDGE), PhysicalParams(), Path(tmp) / "ck", on_iteration=on_iteration,
                  evaluate=evaluate)
        except TimeoutError:
            pass
    return curve


def stable_baselines3(seed: int, budget_s: float, evaluator: Evaluator, out: Path) -> Curve:
    """The same for SB3 PPO (rl-zoo3 tuned) on Reacher-v5, evaluated every 2,048 env steps."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    curve = Curve(out / f"sb3_seed{seed}.csv", ("eval_return",), crossed_threshold)

    class Evaluate(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % SB3_EVAL_EVERY:
                return True
            env = self.model.get_env()
            (r,) = curve.evaluate(self.num_timesteps, lambda: (
                evaluator(lambda obs: self.model.predict(env.normalize_obs(obs), deterministic=True)[0]),))
            return r < THRESHOLD and curve.train_s() < budget_s

    curve.start = time.perf_counter()
    env = VecNormalize(make_vec_env("Reacher-v5", n_envs=1, seed=seed))
    PPO("MlpPolicy", env, seed=seed, device="cpu", **RL_ZOO_REACHER).learn(10_000_000, callback=Evaluate())
    return curve


def physics_floor(env_steps: int) -> float:
    """Seconds ``mujoco.rollout`` takes for ``env_steps`` reacher env steps: 64 envs, 2 threads, the task's substeps."""
    task, n = load("reacher"), SIM2EDGE["num_envs"]
    models = [copy.deepcopy(task.model) for _ in range(n)]
    datas = [mujoco.MjData(task.model) for _ in range(2)]
    state = np.zeros((n, mujoco.mj_stateSize(task.model, STATE_SPEC)))
    mujoco.mj_getState(task.model, datas[0], state[0], STATE_SPEC)
    state[:] = state[0]
    out = np.zeros((n, task.decimation, state.shape[1]))
    controls = np.random.default_rng(0).uniform(-1, 1, (task.episode_steps, n, task.decimation, task.model.nu))
    with rollout.Rollout(nthread=2) as pool:
        start = time.perf_counter()
        for step in range(max(1, -(-env_steps // n))):
            pool.rollout(models, datas, state, controls[step % task.episode_steps], nstep=task.decimation,
                         skip_checks=True, state=out, chunk_size=-(-n // 2))
            state[:] = out[:, -1]
        return time.perf_counter() - start


def breakdown(iterations: int = 30) -> None:
    """Where sim2edge's training time goes, on ``iterations`` iterations without evaluation, timing
    ``mujoco.rollout`` (physics), the env step around it, the actor/critic's ``act`` and the rollout storage."""
    from rsl_rl.algorithms import PPO

    spent: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    targets = [(rollout.Rollout, "rollout", "physics"), (stages.rsl_env.RslRlEnv, "step", "env"),
               (PPO, "act", "inference"), (PPO, "process_env_step", "storage"), (PPO, "compute_returns", "returns")]
    phase = {"collect": 0.0, "update": 0.0}

    def on_iteration(it: int, m: dict[str, float]) -> None:
        for k in phase:
            phase[k] += m[f"{k}_time_s"]

    cfg = TrainConfig(seed=0, **{**SIM2EDGE, "iterations": iterations, "eval_every": 0, "target_return": None})
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as patches:
        for owner, attr, name in targets:
            patches.enter_context(mock.patch.object(owner, attr, timed(name, getattr(owner, attr))))
        start = time.perf_counter()
        train(cfg, PhysicalParams(), Path(tmp) / "ck", on_iteration=on_iteration)
        total = time.perf_counter() - start
    collected = spent["env"] + spent["inference"] + spent["storage"] + spent["returns"]
    parts = {
        "physics (mujoco.rollout, 2 threads)": spent["physics"],
        "env Python (obs, reward, resets, numpy↔torch)": spent["env"] - spent["physics"],
        "policy inference (PPO.act: actor + critic)": spent["inference"],
        "rollout storage and returns (rsl_rl)": spent["storage"] + spent["returns"],
        "collection loop rest": phase["collect"] - collected,
        "PPO update (5 epochs × 4 minibatches)": phase["update"],
        "rest (setup, state copies, metrics, checkpoint)": total - phase["collect"] - phase["update"],
    }
    steps = iterations * SIM2EDGE["num_envs"] * SIM2EDGE["steps_per_env"]
    print(f"sim2edge time breakdown, {iterations} iterations ({steps:,} env steps), {total:.1f} s in all:")
    for name, s in parts.items():
        print(f"  {name:48s} {s:6.2f} s  {100 * s / total:5.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 5 s per side (smoke test)")
    ap.add_argument("--out", type=Path, help="directory for the curves (default: a new temporary directory)")
    ap.add_argument("--breakdown", action="store_true", help="also time sim2edge's phases on a short run")
    args = ap.parse_args()
    seeds, budget_s = ((0,), 5.0) if args.quick else ((0, 1), 600.0)
    out = args.out or Path(tempfile.mkdtemp(prefix="ttt-"))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"reacher: training seconds to deterministic return ≥ {THRESHOLD} on Reacher-v5 ({EVAL_EPISODES} fixed "
          f"episodes), budget {budget_s:.0f} s per side, commit {commit}; curves in {out}", flush=True)
    evaluator = Evaluator()
    ours, theirs, floors = [], [], []
    print(f"{'seed':>4}  {'sim2edge s':>10} {'env steps':>10}  {'floor s':>8} {'÷floor':>7}  "
          f"{'SB3 s':>8} {'env steps':>10}  {'SB3÷sim2edge':>12}", flush=True)
    for seed in seeds:
        ours.append(sim2edge(seed, budget_s, evaluator, out))
        floors.append(physics_floor(ours[-1].reached[1]))
        theirs.append(stable_baselines3(seed, budget_s, evaluator, out))
        (a, steps), (b, their_steps) = ours[-1].reached, theirs[-1].reached
        print(f"{seed:>4}  {ours[-1].shown():>10} {steps:>10,}  {floors[-1]:8.2f} {a / floors[-1]:6.1f}×  "
              f"{theirs[-1].shown():>8} {their_steps:>10,}  {b / a:11.1f}×", flush=True)
    a, b, f = (np.mean([c.reached[0] for c in ours]), np.mean([c.reached[0] for c in theirs]), np.mean(floors))
    note = "" if all(c.crossed for c in ours + theirs) else " (not every run crossed: '>' rows are lower bounds)"
    print(f"mean: sim2edge {a:.1f} s, SB3 {b:.1f} s, floor {f:.2f} s → SB3 / sim2edge {b / a:.1f}× (target ≥ 20×: "
          f"{'met' if b / a >= 20 else 'not met'}), sim2edge / floor {a / f:.1f}× (target ≤ 3×: "
          f"{'met' if a / f <= 3 else 'not met'}){note}")
    print(f"curves: {', '.join(str(c.path) for c in ours + theirs)}")
    if args.breakdown:
        breakdown()


if __name__ == "__main__":
    main()
