"""A gymnasium ``VectorEnv`` over :class:`BatchedEnv`, so users' own tooling can drive a task.

Autoreset mode, in ``metadata["autoreset_mode"]``:

- ``NEXT_STEP`` (default, gymnasium's own): the step that ends an episode returns its last
  observation; the next step returns the reset observation with reward 0, not terminated or
  truncated, and ignores that environment's action. Gymnasium's observation wrappers need it.
- ``SAME_STEP`` (faster: no environment idles for a step): a finished environment returns its
  reset observation at once, and ``infos["final_obs"]`` (mask ``infos["_final_obs"]``) holds its
  last observation, ``infos["final_info"]`` its ``episode_return`` and ``success``.

Under ``NEXT_STEP`` the ending step's infos carry ``episode_return`` and ``success`` (with masks).
Actions are the normalized policy outputs in [-1, 1]; a row holding NaN/Inf gets the task's default
action, as on the device, counted per environment in ``infos["nonfinite_actions"]`` since ``reset``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from stages.sim.env import BatchedEnv
from stages.sim.gym_env import action_space, is_noisy, observation_space, safe_actions
from stages.sim.params import PhysicalParams, Randomization, actuated_dofs, apply_params
from stages.sim.registry import load

MODES = (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP)


class GymVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` copies of one task; ``obs_names`` and ``action_names`` name the single spaces' components."""

    def __init__(self, task: str, num_envs: int, params: PhysicalParams | None = None,
                 randomization: Randomization | None = None, seed: int = 0, nthread: int = 2,
                 autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP) -> None:
        try:
            mode = AutoresetMode(autoreset_mode)
        except ValueError:
            mode = None
        if mode not in MODES:
            shown = getattr(autoreset_mode, "value", autoreset_mode)
            raise ValueError(f"autoreset_mode {shown!r} is not supported; valid: {', '.join(m.value for m in MODES)}")
        self.metadata = {"autoreset_mode": mode}
        self.task = load(task)
        self.env = BatchedEnv(self.task, num_envs, params=params, randomization=randomization, seed=seed, nthread=nthread)
        self.num_envs = num_envs
        self.single_observation_space = observation_space(self.task, is_noisy(self.env.centre, randomization))
        self.single_action_space = action_space(self.task)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.obs_names = tuple(t.name for t in self.task.observations)
        self.action_names = tuple(t.name for t in self.task.actions)
        self.nonfinite_actions = np.zeros(num_envs, dtype=np.int64)
        self._pending = np.zeros(num_envs, dtype=bool)
        """NEXT_STEP: environments whose episode ended in the last step; their reset observation is due."""
        self._reset_obs = np.zeros((num_envs, self.task.obs_dim), dtype=np.float32)
        self._actuated = actuated_dofs(self.task.model)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            if not isinstance(seed, (int, np.integer)):
                raise ValueError(f"seed must be one int (one generator drives all {self.num_envs} environments), "
                                 f"got {seed!r}")
            self.env.rng = np.random.default_rng(seed)
            self.action_space.seed(seed)
        self._pending[:] = False
        self.nonfinite_actions[:] = 0
        return self.env.reset(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        a, bad = safe_actions(actions, (self.num_envs, self.task.act_dim), self.task)
        self.nonfinite_actions += bad
        if self.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP:
            return self._step_same(a)
        return self._step_next(a)

    def _infos(self) -> dict:
        return {"nonfinite_actions": self.nonfinite_actions.copy(), "_nonfinite_actions": np.ones(self.num_envs, bool)}

    def _step_same(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        r = self.env.step(a)
        infos = self._infos()
        if r.done.any():
            final = np.full(self.num_envs, None, dtype=object)
            for i, o in zip(np.flatnonzero(r.done), r.final_obs):
                final[i] = o
            infos.update({"final_obs": final, "_final_obs": r.done.copy(),
                          "final_info": self._episode_infos(r.done, r.finished_returns, r.finished_success),
                          "_final_info": r.done.copy()})
        return r.obs, r.reward.astype(np.float64), r.terminated, r.truncated, infos

    def _step_next(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        # the batched env steps all N; environments due a reset observation are stepped from their reset state
        # with the default action, then put back, so they start their episode in the next call
        pending, rows = self._pending.copy(), np.flatnonzero(self._pending)
        held = self._hold(rows)
        a[rows] = 0.0
        r = self.env.step(a)
        self._put_back(rows, held, r.done)
        done = r.done & ~pending
        kept = ~pending[r.done]  # the finished_* arrays follow np.flatnonzero(r.done)
        obs, reward = r.obs.copy(), r.reward.astype(np.float64)
        obs[pending], reward[pending] = self._reset_obs[pending], 0.0
        terminated, truncated = r.terminated & ~pending, r.truncated & ~pending
        infos = self._infos()
        if done.any():
            self._reset_obs[done] = r.obs[done]  # the batched env has reset them already
            obs[done] = r.final_obs[kept]
            infos.update(self._episode_infos(done, r.finished_returns[kept], r.finished_success[kept]))
        self._pending = done
        return obs, reward, terminated, truncated, infos

    def _episode_infos(self, done: np.ndarray, returns: np.ndarray, success: np.ndarray) -> dict:
        ret, ok = np.zeros(self.num_envs), np.zeros(self.num_envs, dtype=bool)
        ret[done], ok[done] = returns, success
        return {"episode_return": ret, "_episode_return": done.copy(), "success": ok, "_success": done.copy()}

    def _hold(self, rows: np.ndarray) -> dict:
        """The per-environment state of ``rows`` (every array the batched env snapshots, and their physics)."""
        arrays = {k: np.take(getattr(self.env, k), rows, axis=self._row_axis(k)) for k in BatchedEnv._SNAPSHOT}
        return {"arrays": arrays, "params": [self.env.params[i] for i in rows]}

    def _put_back(self, rows: np.ndarray, held: dict, done: np.ndarray) -> None:
        for k, v in held["arrays"].items():
            getattr(self.env, k)[(slice(None),) * self._row_axis(k) + (rows,)] = v
        for i, p in zip(rows, held["params"]):
            if done[i] and self.env.randomization:  # its auto-reset drew new physics: restore the held ones
                apply_params(self.env.models[i], self.task.model, p, self.task.mass_mask, self._actuated,
                             self.env._datas[0])
            self.env.params[i] = p

    @staticmethod
    def _row_axis(name: str) -> int:
        """The environment axis of a batched-env array: (N, ...), but the action queue is (latency, N, nu) and the
        observation history (delay, N, obs_dim)."""
        return 1 if name in ("_action_queue", "_obs_history") else 0
