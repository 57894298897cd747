"""Sim rollouts in the log format: the reference-robot stand-in, the twin, or any model, under
random excitation or an exported ONNX policy (run through the device's runtime code)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from edge.runtime import OnnxRuntime
from stages import logs
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.task import Task


def excitation(rng: np.random.Generator, steps: int, n: int, nu: int, smoothing: float,
               scale: float = 1.0) -> np.ndarray:
    """Smooth random actions in [-1, 1]: an AR(1) process of std ``scale``, clipped, (steps, n, nu)."""
    out = np.zeros((steps, n, nu), dtype=np.float32)
    a = np.zeros((n, nu))
    for t in range(steps):
        a = smoothing * a + np.sqrt(1 - smoothing**2) * rng.standard_normal((n, nu))
        out[t] = np.clip(scale * a, -1, 1)
    return out


def record(task: Task, params: PhysicalParams, episodes: int, seed: int, out: Path, device_id: str,
           smoothing: float = 0.8, policy: Path | None = None, policy_version: str = "excitation",
           amplitude: float | None = None) -> Path:
    """Roll out ``episodes`` episodes (all in parallel) and write them as one log file ``out``.

    Without a ``policy`` the actions are random ``excitation`` of std ``amplitude`` (default: the task's
    ``excitation_scale``).

    The measured joint state carries the same sensor noise (``params.obs_noise``) as the
    observations; ``ctrl`` is what was commanded, before the robot's actuation latency.
    """
    env = BatchedEnv(task, episodes, params=params, seed=seed, terminate=False)
    rng = np.random.default_rng(seed + 1)
    steps = task.episode_steps
    runtime = OnnxRuntime(policy) if policy else None
    actions = None if runtime else excitation(rng, steps, episodes, task.act_dim, smoothing,
                                                   task.excitation_scale if amplitude is None else amplitude)
    rec: dict[str, list[np.ndarray]] = {k: [] for k in ("obs", "act", "ctrl", "qpos", "qvel", "inference_ms")}
    obs = env.observe()
    for t in range(steps):
        if runtime:
            start = time.perf_counter()
            ctrl = runtime.run(obs)
            rec["inference_ms"].append(np.full(episodes, (time.perf_counter() - start) * 1e3 / episodes))
            action = np.clip((np.nan_to_num(ctrl) - task.action_default) / task.action_scale, -1, 1)
        else:
            action = actions[t]
            rec["inference_ms"].append(np.zeros(episodes))
        rec["obs"].append(obs)
        rec["qpos"].append(env.qpos + rng.normal(0, params.obs_noise, env.qpos.shape))
        rec["qvel"].append(env.qvel + rng.normal(0, params.obs_noise, env.qvel.shape))
        rec["act"].append(action)
        rec["ctrl"].append(task.action_default + task.action_scale * action)
        obs = env.step(action).obs
    arrays = {k: np.stack(v, axis=1) for k, v in rec.items()}  # (episodes, steps, dim)
    obs_names = [o.name for o in task.observations]
    act_names = [a.name for a in task.actions]
    table = pa.concat_tables([
        logs.episode_table(e, task.ctrl_dt, obs_names, act_names,
                           *(arrays[k][e] for k in ("obs", "act", "ctrl", "qpos", "qvel", "inference_ms")),
                           policy_version=policy_version, device_id=device_id)
        for e in range(episodes)
    ])
    out.parent.mkdir(parents=True, exist_ok=True)
    logs.write(table, out)
    return out
