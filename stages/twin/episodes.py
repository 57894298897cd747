"""Seeded episodes of an ONNX policy in a batched environment, with per-episode safety and timing metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mujoco
import numpy as np

from edge.runtime import OnnxRuntime
from stages.sim.env import BatchedEnv
from stages.sim.task import Task

LIMIT_TOLERANCE = 1e-3
"""A joint counts as at its limit within this fraction of its range."""


@dataclass
class Episodes:
    """One batch of finished episodes. Per-episode arrays have shape (N,); ``qpos`` is (T, N, nq)."""

    returns: np.ndarray
    success: np.ndarray
    fell: np.ndarray
    """Ended early by the task's termination (a fall, for legged tasks)."""
    steps: np.ndarray
    nan_actions: np.ndarray
    """Control steps whose action had a NaN or Inf."""
    limit_steps: np.ndarray
    """Control steps with a robot joint at its range limit."""
    saturated: np.ndarray
    """Fraction of action components at the actuator limit."""
    smoothness: np.ndarray
    """Mean |a_t − a_{t−1}| in normalized action units (lower is smoother)."""
    latency_ms: np.ndarray
    """(T,) one observation → action through the runtime, timed in each control step; it drives episode 0."""
    qpos: np.ndarray
    mocap: np.ndarray | None = None
    """(T, N, 3·nmocap) mocap body positions in force during each step (a task's goal marker), or None."""
    metrics: dict[str, np.ndarray] = field(default_factory=dict)
    """{name: (N,)} each of the task's metrics averaged over the episode's control steps."""


SCALAR_JOINTS = (int(mujoco.mjtJoint.mjJNT_HINGE), int(mujoco.mjtJoint.mjJNT_SLIDE))
"""Joint types with one qpos and one dof, as ints: numpy's ints are never ``in`` a tuple of MuJoCo's enums."""


def limited_joints(task: Task) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qpos indices, lower and upper limits of the robot's range-limited hinge and slide joints."""
    m = task.model
    robot = set(task.replayed_qpos.tolist())
    ids = [j for j in range(m.njnt) if m.jnt_limited[j] and int(m.jnt_type[j]) in SCALAR_JOINTS
           and m.jnt_qposadr[j] in robot]
    adr = np.array([m.jnt_qposadr[j] for j in ids], dtype=int)
    low, high = (m.jnt_range[ids].T if ids else (np.zeros(0), np.zeros(0)))
    return adr, low, high


def run_episodes(policy: OnnxRuntime, env: BatchedEnv) -> Episodes:
    """One episode per environment with the ONNX policy (the graph outputs actuator controls)."""
    task, n = env.task, env.num_envs
    adr, low, high = limited_joints(task)
    tol = LIMIT_TOLERANCE * (high - low)
    returns, success, fell, done = np.zeros(n), np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    steps, nan_actions, limit_steps = np.zeros(n, int), np.zeros(n, int), np.zeros(n, int)
    saturated, jerk = np.zeros(n), np.zeros(n)
    metric_sums = {m.name: np.zeros(n) for m in task.metrics}
    latency, trajectory, marks = [], [], []
    previous = None
    obs = env.reset()
    for _ in range(task.episode_steps):
        ctrl = policy.run(obs)
        start = time.perf_counter()
        ctrl[0] = policy.run(obs[:1])[0]
        latency.append((time.perf_counter() - start) * 1e3)
        live = ~done
        bad = ~np.isfinite(ctrl).all(axis=1)
        action = np.clip((np.nan_to_num(ctrl) - task.action_default) / task.action_scale, -1.0, 1.0)
        if task.mocap:
            marks.append(env.mocap_positions().copy())
        r = env.step(action)
        steps[live] += 1
        nan_actions[live & bad] += 1
        saturated[live] += (np.abs(action[live]) >= 0.999).mean(axis=1)
        for name, value in r.metrics.items():
            metric_sums[name][live] += value[live]
        if previous is not None:
            jerk[live] += np.abs(action[live] - previous[live]).mean(axis=1)
        previous = action
        q = r.qpos
        if len(adr):
            limit_steps[live & ((q[:, adr] <= low + tol) | (q[:, adr] >= high - tol)).any(axis=1)] += 1
        trajectory.append(q)
        newly = np.flatnonzero(r.done)
        fresh = ~done[newly]
        returns[newly[fresh]] = r.finished_returns[fresh]
        success[newly[fresh]] = r.finished_success[fresh]
        fell[newly[fresh]] = r.terminated[newly[fresh]]
        done[newly] = True
        obs = r.obs
        if done.all():
            break
    return Episodes(returns=returns, success=success, fell=fell, steps=steps, nan_actions=nan_actions,
                    limit_steps=limit_steps, saturated=saturated / np.maximum(steps, 1),
                    smoothness=jerk / np.maximum(steps - 1, 1), latency_ms=np.array(latency), qpos=np.stack(trajectory),
                    mocap=np.stack(marks) if marks else None,
                    metrics={name: total / np.maximum(steps, 1) for name, total in metric_sums.items()})
