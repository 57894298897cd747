"""Every task under the stock tools: gymnasium's and SB3's env checkers, SB3's PPO, gymnasium's vector wrappers."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import (DtypeObservation, FlattenObservation, NormalizeObservation,
                                       RecordEpisodeStatistics, TransformObservation)
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from stages.sim import gym_registration, registry
from stages.sim.cartpole import CartPole
from stages.sim.gym_env import TaskEnv
from stages.sim.gym_vector import GymVectorEnv
from stages.sim.task import Term

IDS = gym_registration.register_all()
ROOT = Path(__file__).resolve().parents[1]
INFINITE_BOUNDS = "Box observation space m"  # gymnasium's hint on ±inf bounds, which its own MuJoCo envs get too


def recorded(fn, *args, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    return [str(w.message) for w in caught]


def test_every_task_has_an_id():
    assert IDS == [gym_registration.env_id(n) for n in registry.names()]
    assert {"sim2edge/Reacher-v0", "sim2edge/Cartpole-v0", "sim2edge/Arm6-v0", "sim2edge/Quadruped-v0"} <= set(IDS)
    assert gym_registration.env_id("my_task") == "sim2edge/MyTask-v0"


@pytest.mark.parametrize("env_id", IDS)
def test_gymnasium_check_env(env_id):
    env = gym.make(env_id)
    task = registry.load(env.spec.kwargs["task"])
    assert env.unwrapped.obs_names == tuple(t.name for t in task.observations)
    assert env.unwrapped.action_names == tuple(t.name for t in task.actions)
    assert env.metadata["render_modes"] == ["rgb_array"]
    space = env.observation_space
    assert space.dtype == np.float32 and space.shape == (task.obs_dim,)
    assert list(space.low) == [t.low for t in task.observations]
    assert list(space.high) == [t.high for t in task.observations]
    unexpected = [m for m in recorded(check_env, env.unwrapped, skip_render_check=True) if INFINITE_BOUNDS not in m]
    assert unexpected == []


@pytest.mark.parametrize("env_id", IDS)
def test_sb3_check_env(env_id):
    assert recorded(sb3_check_env, gym.make(env_id), warn=True) == []


RENDER = """
import gymnasium as gym, numpy as np
from gymnasium.utils.env_checker import check_env
env = gym.make("stages.sim.gym_registration:sim2edge/Cartpole-v0", render_mode="rgb_array")
check_env(env.unwrapped, skip_render_check=False)
env.reset(seed=0)
first = env.render()
for _ in range(15):
    env.step(np.ones(1, np.float32))
moved = env.render()
print(first.shape, first.dtype, int(np.abs(first.astype(int) - moved).sum() > 0))
"""


def test_render_and_module_id_in_a_fresh_process():
    """``module:id`` registers on import; gymnasium's render checks pass; frames show the state (MuJoCo picks its GL
    backend at import, so this runs in a child with MUJOCO_GL=egl)."""
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RENDER], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    if "rendering is unavailable" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "(180, 240, 3) uint8 1"


@pytest.fixture
def one_torch_thread():
    """A tiny MLP: one thread is faster than two fighting over shared cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sb3_ppo_trains_on_it(one_torch_thread):
    from stable_baselines3 import PPO

    model = PPO("MlpPolicy", gym.make("sim2edge/Reacher-v0"), n_steps=512, batch_size=128, n_epochs=2, seed=0,
                device="cpu")
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(2048)
    episodes = list(model.ep_info_buffer)  # SB3's Monitor: one entry per finished episode
    assert len(episodes) == 2048 // 50 and all(e["l"] == 50 and np.isfinite(e["r"]) for e in episodes)
    after = list(model.policy.parameters())
    assert all(p.isfinite().all() for p in after)
    assert any(not (a == b).all() for a, b in zip(after, before))


@pytest.mark.parametrize("task", registry.names())
def test_declared_bounds_hold_along_random_rollouts(task):
    vec = GymVectorEnv(task, 8, seed=0)
    obs, _ = vec.reset(seed=0)
    for _ in range(120):
        assert vec.observation_space.contains(obs)
        obs, *_ = vec.step(vec.action_space.sample())


def test_bounds_a_task_breaks_are_named_at_registration():
    @dataclass(frozen=True)
    class Lying(CartPole):
        observations: tuple = (Term("cart_pos", "m", low=1.0, high=2.0), *CartPole.observations[1:])

    with pytest.raises(ValueError, match=r"observation term 'cart_pos' outside its bounds \[1.0, 2.0\]"):
        Lying().validate()


def test_seeded_reset_is_reproducible():
    env = gym.make("sim2edge/Quadruped-v0")
    first, again, other = env.reset(seed=3)[0], env.reset(seed=3)[0], env.reset(seed=4)[0]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_wrong_action_shape_is_one_clear_line():
    env = gym.make("sim2edge/Reacher-v0")
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"^task 'reacher': action has shape \(3,\), expected \(2,\) \(actions "
                                         r"shoulder, elbow\)$"):
        env.unwrapped.step(np.zeros(3))
    vec = gym.make_vec("sim2edge/Reacher-v0", num_envs=4)
    vec.reset(seed=0)
    with pytest.raises(ValueError, match=r"action has shape \(2,\), expected \(4, 2\)"):
        vec.step(np.zeros(2))


def test_nonfinite_action_applies_the_default_and_is_counted():
    env, reference = gym.make("sim2edge/Cartpole-v0").unwrapped, gym.make("sim2edge/Cartpole-v0").unwrapped
    env.reset(seed=1)
    reference.reset(seed=1)
    for bad, count in ((np.nan, 1), (np.inf, 2), (0.3, 2)):
        obs, reward, *_, info = env.step(np.array([bad]))
        want, want_reward, *_ = reference.step(np.array([bad if np.isfinite(bad) else 0.0]))  # 0 = the default action
        np.testing.assert_array_equal(obs, want)
        assert reward == want_reward and info["nonfinite_actions"] == count
    assert env.reset(seed=1)[1]["nonfinite_actions"] == 0

    vec = gym.make_vec("sim2edge/Cartpole-v0", num_envs=3)
    vec.reset(seed=0)
    obs, *_, infos = vec.step(np.array([[0.5], [np.nan], [-np.inf]], np.float32))
    assert np.isfinite(obs).all() and infos["nonfinite_actions"].tolist() == [0, 1, 1]


def test_make_vec_gives_the_batched_env_next_step_by_default():
    vec = gym.make_vec("sim2edge/Arm6-v0", num_envs=8, vectorization_mode="vector_entry_point")
    assert isinstance(vec, GymVectorEnv) and vec.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
    assert vec.observation_space.shape == (8, 18) and vec.action_space.shape == (8, 6)
    same = gym.make_vec("sim2edge/Arm6-v0", num_envs=2, autoreset_mode=AutoresetMode.SAME_STEP)
    assert same.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    sync = gym.make_vec("sim2edge/Arm6-v0", num_envs=2, vectorization_mode="sync")  # gymnasium's own, over TaskEnv
    assert sync.reset(seed=0)[0].shape == (2, 18)
    with pytest.raises(ValueError, match="autoreset_mode 'Disabled' is not supported; valid: NextStep, SameStep"):
        GymVectorEnv("arm6", 2, autoreset_mode=AutoresetMode.DISABLED)
    with pytest.raises(ValueError, match=r"seed must be one int \(one generator drives all 8 environments\)"):
        vec.reset(seed=list(range(8)))


def test_next_step_autoreset_matches_same_step_one_step_later():
    """NEXT_STEP returns the last observation when an episode ends, then the reset observation with reward 0
    without stepping that environment; SAME_STEP (same seed and actions) returns the reset observation at once."""
    n = 4
    nxt, same = GymVectorEnv("cartpole", n, seed=0), GymVectorEnv("cartpole", n, seed=0, autoreset_mode="SameStep")
    nxt.reset(seed=5)
    same.reset(seed=5)
    actions = np.random.default_rng(0).uniform(-1, 1, (400, n, 1)).astype(np.float32)
    for t in range(400):
        obs, reward, terminated, truncated, infos = nxt.step(actions[t])
        s_obs, s_reward, s_term, s_trunc, s_infos = same.step(actions[t])
        np.testing.assert_array_equal(reward, s_reward)
        ended = terminated | truncated
        if ended.any():
            break
    assert ended.any() and (ended == (s_term | s_trunc)).all()
    i = np.flatnonzero(ended)
    np.testing.assert_array_equal(obs[i], np.stack(s_infos["final_obs"][i]))
    np.testing.assert_allclose(infos["episode_return"][i], s_infos["final_info"]["episode_return"][i])
    # next call: the ended envs give their reset observation, reward 0, and ignore their (NaN) action
    step = actions[t + 1].copy()
    step[i] = np.nan
    obs, reward, terminated, truncated, infos = nxt.step(step)
    np.testing.assert_array_equal(obs[i], s_obs[i])
    assert (reward[i] == 0).all() and not (terminated[i] | truncated[i]).any()
    s_obs, *_ = same.step(actions[t + 1])
    live = np.setdiff1d(np.arange(n), i)
    np.testing.assert_array_equal(obs[live], s_obs[live])
    # and the call after that steps them from their reset state as SAME_STEP did one call earlier
    step = actions[t + 2].copy()
    step[i] = actions[t + 1][i]
    obs, *_ = nxt.step(step)
    np.testing.assert_array_equal(obs[i], s_obs[i])


def test_observation_wrappers_run_across_autoresets():
    vec = gym.make_vec("sim2edge/Cartpole-v0", num_envs=4)
    normalizer = NormalizeObservation(TransformObservation(FlattenObservation(vec), lambda o: 2.0 * o))
    env = RecordEpisodeStatistics(DtypeObservation(normalizer, np.float64))
    obs, _ = env.reset(seed=0)
    episodes = 0
    for _ in range(80):
        obs, reward, terminated, truncated, infos = env.step(env.action_space.sample())
        assert obs.dtype == np.float64 and obs.shape == (4, 5) and np.isfinite(obs).all()
        if "episode" in infos:
            ended = infos["_episode"]
            episodes += int(ended.sum())
            np.testing.assert_allclose(infos["episode"]["r"][ended], infos["episode_return"][ended], rtol=1e-5)
    assert episodes >= 4  # random actions topple the pole within a few dozen steps
    assert normalizer.obs_rms.count == pytest.approx(4 * 81, abs=1)  # every step's observations, resets included
    same = gym.make_vec("sim2edge/Cartpole-v0", num_envs=2, autoreset_mode=AutoresetMode.SAME_STEP)
    with pytest.raises(ValueError, match="NEXT_STEP"):
        NormalizeObservation(same)  # why NEXT_STEP is the default


@pytest.fixture
def one_step_cartpole(own_task):
    """A task registered at run time: cart-pole with one-step episodes."""
    own_task("one_step", lambda: CartPole(episode_steps=1))
    yield "one_step"
    gym.registry.pop("sim2edge/OneStep-v0", None)


def test_registering_a_task_at_run_time(one_step_cartpole):
    assert "sim2edge/OneStep-v0" in gym_registration.register_all()
    env = gym.make("sim2edge/OneStep-v0")
    assert isinstance(env.unwrapped, TaskEnv) and env.unwrapped.obs_names[0] == "cart_pos"
    env.reset(seed=0)
    assert env.step(np.zeros(1))[3]  # truncated after its one step


def test_next_step_keeps_the_physics_drawn_at_the_reset(one_step_cartpole):
    """Every episode is one step long, so the idle step of NEXT_STEP ends (and re-randomizes) in the batched env
    too; it is undone: the next episode runs with the state and physics drawn when it was reset."""
    randomization = registry.load(one_step_cartpole).randomization
    nxt = GymVectorEnv(one_step_cartpole, 4, randomization=randomization, autoreset_mode="NextStep")
    same = GymVectorEnv(one_step_cartpole, 4, randomization=randomization, autoreset_mode="SameStep")
    nxt.reset(seed=2)
    same.reset(seed=2)
    push = np.ones((4, 1), np.float32)
    assert nxt.step(push)[3].all() and same.step(push)[3].all()
    drawn = list(nxt.env.params)
    assert drawn == list(same.env.params)
    obs, reward, *_ = nxt.step(push)  # the idle step: reset observations
    assert (reward == 0).all() and nxt.env.params == drawn
    obs, _, _, truncated, _ = nxt.step(push)
    *_, infos = same.step(push)
    assert truncated.all()
    np.testing.assert_array_equal(obs, np.stack(infos["final_obs"]))
