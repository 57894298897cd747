"""Every registered task: build, reset, step, shapes, no NaN, randomization, seeded replay."""

from __future__ import annotations

import numpy as np
import pytest

from stages.sim import registry
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams, Randomization, sample_params


@pytest.mark.parametrize("name", registry.names())
def test_task_builds_resets_and_steps(name):
    task = registry.load(name)
    m = task.model
    assert task.obs_dim == len(task.observations) and task.act_dim == len(task.actions) == m.nu
    assert task.ctrl_dt == pytest.approx(m.opt.timestep * task.decimation)
    env = BatchedEnv(task, 8, randomization=task.randomization, seed=0)
    obs = env.reset()
    assert obs.shape == (8, task.obs_dim) and env.qpos.shape == (8, m.nq) and env.qvel.shape == (8, m.nv)
    rng = np.random.default_rng(1)
    for _ in range(20):
        r = env.step(rng.uniform(-1, 1, (8, task.act_dim)))
        assert r.obs.shape == (8, task.obs_dim) and r.reward.shape == (8,) and r.terminated.dtype == bool
        assert np.all(np.isfinite(r.obs)) and np.all(np.isfinite(r.reward)) and np.all(np.isfinite(env.state))
    assert np.all(task.action_scale > 0) and task.action_default.shape == (task.act_dim,)


@pytest.mark.parametrize("name", registry.names())
def test_randomization_changes_the_model(name):
    task = registry.load(name)
    env = BatchedEnv(task, 4, randomization=task.randomization, seed=0)
    damping = np.stack([m.dof_damping for m in env.models])
    gain = np.stack([m.actuator_gainprm[:, 0] for m in env.models])
    assert not np.allclose(damping[0], damping[1]) and not np.allclose(gain[0], gain[1])
    mass = task.mass_mask
    assert not np.allclose(env.models[0].body_mass[mass], task.model.body_mass[mass])
    assert np.array_equal(env.models[0].body_mass[~mass], task.model.body_mass[~mass])


@pytest.mark.parametrize("name", registry.names())
def test_seeded_replay_is_identical(name):
    task = registry.load(name)

    def trajectory(seed):
        env = BatchedEnv(task, 4, randomization=task.randomization, seed=seed)
        actions = np.random.default_rng(7).uniform(-1, 1, (30, 4, task.act_dim))
        return np.stack([env.step(a).obs for a in actions])

    assert np.array_equal(trajectory(3), trajectory(3))
    assert not np.array_equal(trajectory(3), trajectory(4))


def test_unknown_task_lists_valid_names():
    with pytest.raises(KeyError, match="valid tasks: arm6, cartpole, quadruped, reacher"):
        registry.load("no-such-robot")


def test_sample_params_is_pure_and_within_ranges():
    centre = PhysicalParams(damping=2.0)
    ranges = Randomization(damping=0.25, actuator_gain=0.0, mass=0.1)
    a = sample_params(centre, ranges, np.random.default_rng(5))
    b = sample_params(centre, ranges, np.random.default_rng(5))
    assert a == b and centre.damping == 2.0
    assert 1.5 <= a.damping <= 2.5 and a.actuator_gain == 1.0


def test_action_latency_delays_the_applied_control():
    task = registry.load("cartpole")
    env = BatchedEnv(task, 1, params=PhysicalParams(latency_steps=2), seed=0)
    applied = [env.controls_preview(np.array([[a]])).item() for a in (0.5,)]
    env.step(np.array([[0.5]]))
    env.step(np.array([[0.7]]))
    applied.append(env.controls_preview(np.array([[0.9]])).item())
    assert applied == [0.0, 0.5]


def test_latency_randomized_per_environment_delays_each_by_its_own_steps():
    task = registry.load("cartpole")
    ranges = Randomization(latency_steps=2)
    env = BatchedEnv(task, 64, params=PhysicalParams(latency_steps=1), randomization=ranges, seed=3)
    assert set(env.latency.tolist()) == {1, 2, 3} and [p.latency_steps for p in env.params] == env.latency.tolist()
    actions = np.linspace(-0.9, 0.9, 5)
    applied = []
    for a in actions:
        applied.append(env.controls_preview(np.full((64, 1), a))[:, 0])
        env.step(np.full((64, 1), a))
    scale, default = task.action_scale[0], task.action_default[0]
    for i, lat in enumerate(env.latency):
        expected = [0.0 if t < lat else actions[t - lat] for t in range(len(actions))]
        assert np.allclose((np.array(applied)[:, i] - default) / scale, expected), (i, lat)
    again = BatchedEnv(task, 64, params=PhysicalParams(latency_steps=1), randomization=ranges, seed=3)
    assert np.array_equal(again.latency, BatchedEnv(task, 64, params=PhysicalParams(latency_steps=1),
                                                    randomization=ranges, seed=3).latency)
    assert sample_params(PhysicalParams(), Randomization(), np.random.default_rng(0)).latency_steps == 0


def test_per_substep_actions_take_effect_from_their_substep():
    task = registry.load("cartpole")
    held, stepped, switched = (BatchedEnv(task, 2, seed=4) for _ in range(3))
    action = np.array([[0.6], [-0.3]], np.float32)
    a = held.step(action)
    b = stepped.step(action, substeps=np.repeat(action[:, None], task.decimation, axis=1))
    assert np.array_equal(a.obs, b.obs) and np.array_equal(a.reward, b.reward)
    late = np.zeros((2, task.decimation, 1), np.float32)
    late[:, -1] = action  # the action arrives in the period's last substep
    c = switched.step(action, substeps=late)
    assert not np.allclose(c.qpos, a.qpos) and np.array_equal(switched.last_action, held.last_action)
    with pytest.raises(ValueError, match="latency_steps 0, this env has 1"):
        BatchedEnv(task, 2, params=PhysicalParams(latency_steps=1)).step(action, substeps=late)
