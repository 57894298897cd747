"""A gymnasium ``VectorEnv`` over :class:`BatchedEnv`, so users' own tooling can drive a task.

Autoreset mode is ``SAME_STEP``: a finished environment returns its reset observation at once,
and ``infos["final_obs"]`` (with mask ``infos["_final_obs"]``) holds its last observation, as
gymnasium's own vector envs do. Actions are the normalized policy outputs in [-1, 1].
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Box
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams, Randomization
from stages.sim.registry import load


class GymVectorEnv(gym.vector.VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, task: str, num_envs: int, params: PhysicalParams | None = None,
                 randomization: Randomization | None = None, seed: int = 0, nthread: int = 2) -> None:
        self.task = load(task)
        self.env = BatchedEnv(self.task, num_envs, params=params, randomization=randomization, seed=seed, nthread=nthread)
        self.num_envs = num_envs
        self.single_observation_space = Box(-np.inf, np.inf, (self.task.obs_dim,), np.float32)
        self.single_action_space = Box(-1.0, 1.0, (self.task.act_dim,), np.float32)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.env.rng = np.random.default_rng(seed)
            self.action_space.seed(seed)
        return self.env.reset(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        r = self.env.step(np.asarray(actions, dtype=np.float32))
        infos: dict = {}
        if r.done.any():
            final = np.full(self.num_envs, None, dtype=object)
            for i, o in zip(np.flatnonzero(r.done), r.final_obs):
                final[i] = o
            returns, success = np.zeros(self.num_envs), np.zeros(self.num_envs, dtype=bool)
            returns[r.done], success[r.done] = r.finished_returns, r.finished_success
            infos = {"final_obs": final, "_final_obs": r.done.copy(),
                     "final_info": {"episode_return": returns, "_episode_return": r.done.copy(),
                                    "success": success, "_success": r.done.copy()},
                     "_final_info": r.done.copy()}
        return r.obs, r.reward.astype(np.float64), r.terminated, r.truncated, infos
