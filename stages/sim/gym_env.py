"""A single-environment ``gymnasium.Env`` for every task: :class:`BatchedEnv` with one world.

It wraps the batched environment (N = 1, one rollout thread) rather than re-assembling the task's
pieces, so physics, action latency, randomization, termination and truncation are exactly the
code that training and evaluation run. The task truncates its own episodes (``episode_steps``),
so registration adds no ``TimeLimit``.

Actions are the normalized policy outputs in [-1, 1] (ctrl = default + scale · action, the same
action the exported policy emits and the bundle's ``scale`` undoes). A non-finite action is
handled as the device agent does: the task's default action (0: the actuators' range centres) is
applied instead and counted in ``info["nonfinite_actions"]`` (since the last reset).
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium.spaces import Box

from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams, Randomization
from stages.sim.registry import load
from stages.sim.task import Task


def observation_space(task: Task, noisy: bool = False) -> Box:
    """The observation terms' declared bounds, float32; ±inf where unknown, or everywhere when ``noisy``."""
    low = np.array([-np.inf if noisy else t.low for t in task.observations], np.float32)
    high = np.array([np.inf if noisy else t.high for t in task.observations], np.float32)
    return Box(low, high, dtype=np.float32)


def action_space(task: Task) -> Box:
    return Box(-1.0, 1.0, (task.act_dim,), np.float32)


def is_noisy(params: PhysicalParams, randomization: Randomization | None) -> bool:
    """Whether observations get sensor noise added (then no declared bound holds)."""
    return params.obs_noise > 0 or (randomization is not None and randomization.obs_noise > 0)


def safe_actions(action: Any, shape: tuple[int, ...], task: Task) -> tuple[np.ndarray, np.ndarray]:
    """``action`` checked for ``shape``, clipped to [-1, 1] as float32, with every row holding NaN/Inf replaced by
    the default action 0; and the mask of replaced rows (shape ``shape[:-1]``)."""
    a = np.asarray(action, dtype=np.float64)
    if a.shape != shape:
        raise ValueError(f"task {task.name!r}: action has shape {a.shape}, expected {shape} "
                         f"(actions {', '.join(t.name for t in task.actions)})")
    bad = ~np.isfinite(a).all(axis=-1)
    return np.where(bad[..., None], 0.0, np.clip(a, -1.0, 1.0)).astype(np.float32), bad


class TaskEnv(gym.Env[np.ndarray, np.ndarray]):
    """One task as a ``gymnasium.Env``; ``obs_names`` and ``action_names`` name the spaces' components.

    The step that ends an episode adds ``episode_return`` and ``is_success`` (SB3's key for its success rate)
    to ``info``."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": None}

    def __init__(self, task: str, render_mode: str | None = None, params: PhysicalParams | None = None,
                 randomization: Randomization | None = None, width: int = 240, height: int = 180) -> None:
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode {render_mode!r} is not supported; valid: {self.metadata['render_modes']}")
        self.task = load(task)
        self.env = BatchedEnv(self.task, 1, params=params, randomization=randomization, nthread=1)
        self.metadata = {**self.metadata, "render_fps": round(1.0 / self.task.ctrl_dt)}
        self.render_mode, self.size = render_mode, (height, width)
        self.observation_space = observation_space(self.task, is_noisy(self.env.centre, randomization))
        self.action_space = action_space(self.task)
        self.obs_names = tuple(t.name for t in self.task.observations)
        self.action_names = tuple(t.name for t in self.task.actions)
        self.nonfinite_actions = 0
        self._qpos = self.env.qpos[0].copy()
        """The state to render: the last step's, before the batched env's auto-reset."""
        self._mocap = self._marks()
        """Mocap body positions to render (a task's goal marker) in force during that step."""
        self._renderer: mujoco.Renderer | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.env.rng = self.np_random  # gymnasium's seeded generator drives initial states, physics draws, noise
        obs = self.env.reset()[0]
        self.nonfinite_actions = 0
        self._qpos, self._mocap = self.env.qpos[0].copy(), self._marks()
        return obs, {"nonfinite_actions": 0}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        a, bad = safe_actions(action, (self.task.act_dim,), self.task)
        self.nonfinite_actions += int(bad)
        self._mocap = self._marks()
        r = self.env.step(a[None])
        self._qpos = r.qpos[0].copy()
        info: dict = {"nonfinite_actions": self.nonfinite_actions}
        obs = r.obs[0]
        if r.done[0]:  # the batched env has already reset; report the episode's last observation
            obs = r.final_obs[0]
            info.update(episode_return=float(r.finished_returns[0]), is_success=bool(r.finished_success[0]))
        return obs, float(r.reward[0]), bool(r.terminated[0]), bool(r.truncated[0]), info

    def _marks(self) -> np.ndarray | None:
        return self.env.mocap_positions()[0].copy() if self.task.mocap else None

    def render(self) -> np.ndarray | None:
        """An RGB frame (height, width, 3) of the current state, with MuJoCo's offscreen renderer."""
        if self.render_mode is None:
            return None
        if self._renderer is None:
            try:
                self._renderer = mujoco.Renderer(self.env.models[0], *self.size)
            except mujoco.FatalError as e:
                raise RuntimeError(f"MuJoCo offscreen rendering is unavailable (MUJOCO_GL="
                                   f"{os.environ.get('MUJOCO_GL', 'unset')}; try egl or osmesa): {e}") from None
            self._data = mujoco.MjData(self.env.models[0])
            self._camera = mujoco.MjvCamera()
            mujoco.mjv_defaultFreeCamera(self.env.models[0], self._camera)
        self._data.qpos[:] = self._qpos
        if self._mocap is not None:
            self._data.mocap_pos[:] = self._mocap.reshape(-1, 3)
        mujoco.mj_forward(self.env.models[0], self._data)
        self._renderer.update_scene(self._data, self._camera)
        return self._renderer.render()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
