"""Every registered task (and the own-robot example) learns: a short PPO run beats a random policy.

A reward with the wrong sign, an observation that misses what the reward depends on, or an action
scaled to nothing would leave training no better than chance; the other tests of a task check shapes,
finiteness and conformance, which all pass then. The oracle is independent of training's own metrics:
seeded episodes in the nominal model with the deterministic policy against uniform random actions on
the same episodes, and the difference must clear 3 standard errors and a stated fraction of the random
policy's |return|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.train import first_episodes, load_actor, train
from stages.train_config import TrainConfig

EPISODES = 32
# task: (iterations, num_envs, steps_per_env, hidden, margin as a fraction of the random policy's |mean return|)
BUDGETS = {
    "cartpole": (30, 64, 32, (64, 64), 1.0),
    "reacher": (30, 64, 32, (64, 64), 0.3),
    "examples.pendulum:Pendulum": (30, 64, 32, (64, 64), 0.3),
    "arm6": (60, 64, 32, (128, 128), 0.2),
    "quadruped": (40, 128, 24, (128, 64), 0.5),
}
SLOW = {"arm6", "quadruped"}


def episode_returns(task, act) -> np.ndarray:
    """(EPISODES,) the returns of the same seeded episodes in the nominal model under ``act(obs) -> action``."""
    return first_episodes(BatchedEnv(task, EPISODES, params=task.nominal_params(), seed=123), act)[0]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BUDGETS])
def test_a_short_training_beats_a_random_policy(name, tmp_path):
    iterations, envs, steps, hidden, margin = BUDGETS[name]
    task = load(name)
    ckpt = train(TrainConfig(task=name, iterations=iterations, num_envs=envs, steps_per_env=steps, hidden_dims=hidden,
                             seed=0), task.nominal_params(), tmp_path / "ck")
    actor = load_actor(ckpt.path)

    def policy(obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return actor(TensorDict({"policy": torch.from_numpy(obs)}, batch_size=[len(obs)])).clamp(-1, 1).numpy()

    rng = np.random.default_rng(0)
    trained = episode_returns(task, policy)
    random = episode_returns(task, lambda obs: rng.uniform(-1, 1, (len(obs), task.act_dim)).astype(np.float32))
    gap = trained.mean() - random.mean()
    stderr = np.sqrt(trained.var(ddof=1) / EPISODES + random.var(ddof=1) / EPISODES)
    assert gap > 3 * stderr and gap > margin * abs(random.mean()), (name, trained.mean(), random.mean(), stderr)
