"""``reacher`` is gymnasium's Reacher-v5: same model, observation, reward and episode length."""

from __future__ import annotations

import gymnasium as gym
import mujoco
import numpy as np
import pytest

from stages.sim.env import BatchedEnv
from stages.sim.reacher import fingertip
from stages.sim.registry import load


LAG_TOLERANCE = 2e-3
"""gymnasium reads the fingertip from ``data.xpos``, which ``mj_step`` computes *before* its last
integration substep, so its tip-to-target (and the distance reward) lags ours by one 10 ms substep."""


@pytest.fixture(scope="module")
def reacher():
    return load("reacher")


def test_steps_match_gymnasium_reacher_v5(reacher):
    ref = gym.make("Reacher-v5")
    assert ref.spec.max_episode_steps == reacher.episode_steps
    assert ref.unwrapped.dt == pytest.approx(reacher.ctrl_dt)
    env = BatchedEnv(reacher, 1, seed=0, terminate=False)
    rng = np.random.default_rng(3)
    for episode in range(3):
        obs_ref, _ = ref.reset(seed=episode)
        data = ref.unwrapped.data
        env.reset()
        env.state[0, 1 : 1 + reacher.model.nq] = data.qpos
        env.state[0, 1 + reacher.model.nq : 1 + reacher.model.nq + reacher.model.nv] = data.qvel
        np.testing.assert_allclose(env.observe()[0], obs_ref, atol=1e-6)
        for _ in range(reacher.episode_steps):
            action = rng.uniform(-1, 1, size=2).astype(np.float32)
            obs_ref, reward_ref, *_ = ref.step(action)
            step = env.step(action[None])
            if not step.done[0]:  # the batched env auto-resets at the episode's end
                np.testing.assert_allclose(step.obs[0][:8], obs_ref[:8], atol=1e-5)
                np.testing.assert_allclose(step.obs[0][8:], obs_ref[8:], atol=LAG_TOLERANCE)
            assert step.reward[0] == pytest.approx(reward_ref, abs=LAG_TOLERANCE)
        assert step.truncated[0]  # both end after 50 steps


def test_fingertip_kinematics_match_mujoco(reacher):
    data = mujoco.MjData(reacher.model)
    tip = mujoco.mj_name2id(reacher.model, mujoco.mjtObj.mjOBJ_BODY, "fingertip")
    for q in np.random.default_rng(0).uniform(-3, 3, size=(5, 4)):
        data.qpos[:] = q
        mujoco.mj_kinematics(reacher.model, data)
        np.testing.assert_allclose(fingertip(q[None])[0], data.xpos[tip][:2], atol=1e-12)


def test_reset_distribution_follows_reacher_v5(reacher):
    qpos, qvel = reacher.initial_state(np.random.default_rng(0), 2000)
    assert np.all(np.linalg.norm(qpos[:, 2:], axis=1) < 0.2)
    assert np.all(np.abs(qpos[:, :2]) <= 0.1) and np.all(qvel[:, 2:] == 0) and np.all(np.abs(qvel) <= 0.005)


def test_success_is_reaching_the_target(reacher):
    qpos = np.zeros((2, 4))
    qpos[0, 2:] = fingertip(qpos[:1])[0]  # target under the fingertip
    qpos[1, 2:] = (0.0, 0.1)
    assert reacher.succeeded(qpos, np.zeros((2, 4))).tolist() == [True, False]


def test_gymnasium_vector_adapter_drives_like_gymnasium():
    from gymnasium.wrappers.vector import RecordEpisodeStatistics

    from stages.sim.gym_vector import GymVectorEnv

    env = RecordEpisodeStatistics(GymVectorEnv("reacher", 4, seed=0, autoreset_mode="SameStep"))
    obs, _ = env.reset(seed=1)
    assert obs.shape == (4, 10) and env.single_observation_space.contains(obs[0])
    finished = 0
    for t in range(50):
        obs, reward, terminated, truncated, infos = env.step(env.action_space.sample())
        assert obs.shape == (4, 10) and reward.shape == (4,) and not terminated.any()
        if truncated.any():
            finished += int(truncated.sum())
            assert t == 49 and infos["_final_obs"].all() and infos["final_obs"][0].shape == (10,)
            assert np.allclose(infos["episode"]["r"], infos["final_info"]["episode_return"], atol=1e-4)
    assert finished == 4
    again = GymVectorEnv("reacher", 4, seed=0)
    np.testing.assert_array_equal(again.reset(seed=1)[0], GymVectorEnv("reacher", 4).reset(seed=1)[0])
