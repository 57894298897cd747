"""Base pushes: a horizontal force on a floating base, sized by the robot's weight, on real MuJoCo steps."""

from __future__ import annotations

import numpy as np
import pytest

from stages.sim.disturbance import Disturbance
from stages.sim.env import BatchedEnv
from stages.sim.registry import load


@pytest.fixture(scope="module")
def quad():
    return load("quadruped")


def _pair(task, n: int, disturbance: Disturbance, seed: int = 1) -> tuple[BatchedEnv, BatchedEnv]:
    """A pushed environment and an unpushed one with the same initial states."""
    return BatchedEnv(task, n, seed=seed, disturbance=disturbance), BatchedEnv(task, n, seed=seed)


def test_a_base_push_changes_the_base_velocity_by_its_impulse(quad):
    n, push = 8, 0.5
    pushed, plain = _pair(quad, n, Disturbance(push=push, push_on="base", push_every=1, push_steps=1))
    stand = np.zeros((n, quad.act_dim))
    pushed.step(stand)
    plain.step(stand)  # a push never acts in an episode's first step
    np.testing.assert_array_equal(pushed.qvel, plain.qvel)
    pushed.step(stand)
    plain.step(stand)
    dv = pushed.qvel[:, :3] - plain.qvel[:, :3]  # the free joint's linear velocity, world frame
    direction = pushed.push_direction
    np.testing.assert_allclose(np.linalg.norm(direction, axis=1), 1.0)
    assert np.ptp(np.arctan2(direction[:, 1], direction[:, 0])) > 1.0  # random directions in the x–y plane
    impulse = push * 9.81 * quad.ctrl_dt  # F·Δt/m with F = push × m g
    along = np.sum(dv[:, :2] * direction, axis=1) / impulse
    across = (dv[:, 0] * direction[:, 1] - dv[:, 1] * direction[:, 0]) / impulse
    assert np.all((along > 0.7) & (along < 1.3)), along  # the legs give a little: the torso moves ~10% more
    assert np.all(np.abs(across) < 0.1) and np.all(np.abs(dv[:, 2]) < 0.1 * impulse)


def test_no_force_off_phase_or_at_zero_strength(quad):
    n, every, steps = 6, 10, 2
    pushed, plain = _pair(quad, n, Disturbance(push=0.5, push_on="base", push_every=every, push_steps=steps))
    off, _ = _pair(quad, n, Disturbance(push=0.0, push_on="base", push_every=every, push_steps=steps))
    first = np.array([next(t for t in range(1, 2 * every) if (t + p) % every < steps) for p in pushed.push_phase])
    stand = np.zeros((n, quad.act_dim))
    for t in range(first.max() + 1):
        for env in (pushed, plain, off):
            env.step(stand)
        same = np.all(pushed.qvel == plain.qvel, axis=1)
        assert np.array_equal(same, t < first), t  # identical until each env's first on-phase step
        np.testing.assert_array_equal(off.qvel, plain.qvel)


def test_seeded_base_pushes_replay_identically(quad):
    d = Disturbance(push=0.5, push_on="base", push_every=7, push_steps=3)
    runs = [BatchedEnv(quad, 4, seed=s, disturbance=d) for s in (3, 3, 4)]
    rng = np.random.default_rng(0)
    for _ in range(30):
        action = rng.uniform(-0.3, 0.3, (4, quad.act_dim))
        for env in runs:
            env.step(action)
    np.testing.assert_array_equal(runs[0].state, runs[1].state)
    assert not np.allclose(runs[0].qvel[:, :2], runs[2].qvel[:, :2])


def test_a_snapshot_resumes_base_pushes_exactly(quad):
    d = Disturbance(push=0.5, push_on="base", push_every=7, push_steps=3)
    env, resumed = BatchedEnv(quad, 4, seed=3, disturbance=d), BatchedEnv(quad, 4, seed=9, disturbance=d)
    stand = np.zeros((4, quad.act_dim))
    for _ in range(9):  # mid-push for some environments
        env.step(stand)
    resumed.restore(env.snapshot())
    for _ in range(20):
        env.step(stand)
        resumed.step(stand)
    np.testing.assert_array_equal(env.state, resumed.state)


@pytest.mark.parametrize("task", ["cartpole", "arm6"])
def test_a_base_push_needs_a_free_joint(task):
    with pytest.raises(ValueError, match=rf"task '{task}': Disturbance.push_on='base'.*no free joint"):
        BatchedEnv(load(task), 2, disturbance=Disturbance(push=0.3, push_on="base"))
