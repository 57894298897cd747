"""Decoupled PPO for rollouts collected one policy behind (``collector='thread'`` or ``'process'``): the stored
log-probabilities and distribution become the learner's current policy's, and each advantage is weighted by
π_current(a) / π_behaviour(a); a rollout the current policy collected itself is left as it was."""

from __future__ import annotations

import torch

from stages.rsl_env import RslRlEnv, build_algorithm, make_env
from stages.samplers import Sampler, decouple
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.train_config import TrainConfig

CFG = TrainConfig(num_envs=16, steps_per_env=32, hidden_dims=(16, 16), seed=5)


def setup():
    torch.manual_seed(CFG.seed)
    vec_env = RslRlEnv(make_env(CFG, load(CFG.task), PhysicalParams()))
    learner, behaviour = build_algorithm(CFG, vec_env), build_algorithm(CFG, vec_env)  # two random inits
    for alg in (learner, behaviour):
        alg.train_mode()
    return vec_env, learner, behaviour


def current_log_prob(alg, storage) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The learner's log-probabilities of the stored actions, through rsl_rl's own forward pass."""
    with torch.no_grad():
        alg.actor(storage.observations.flatten(0, 1), stochastic_output=True)
        log_prob = alg.actor.get_output_log_prob(storage.actions.flatten(0, 1)).view_as(storage.actions_log_prob)
        return log_prob, tuple(p.clone() for p in alg.actor.output_distribution_params)


def test_a_lagged_rollout_is_centred_on_the_current_policy_with_importance_weighted_advantages():
    vec_env, learner, behaviour = setup()
    Sampler(behaviour, vec_env, CFG)._collect(behaviour)
    learner.storage, behaviour.storage = behaviour.storage, learner.storage
    storage = learner.storage
    behaviour_log_prob, advantages = storage.actions_log_prob.clone(), storage.advantages.clone()
    expected, params = current_log_prob(learner, storage)
    assert (expected - behaviour_log_prob).abs().max() > 0.1  # the two policies differ: the test can fail

    decouple(learner)
    assert torch.allclose(storage.actions_log_prob, expected, atol=1e-5)
    assert torch.allclose(storage.advantages, advantages * torch.exp(expected - behaviour_log_prob), rtol=1e-4,
                          atol=1e-6)
    for stored, current in zip(storage.distribution_params, params, strict=True):
        assert torch.allclose(stored, current.view_as(stored), atol=1e-6)


def test_an_on_policy_rollout_is_left_as_it_was():
    vec_env, learner, _ = setup()
    Sampler(learner, vec_env, CFG)._collect(learner)
    storage = learner.storage
    before = (storage.actions_log_prob.clone(), storage.advantages.clone(),
              *(p.clone() for p in storage.distribution_params))
    decouple(learner)
    after = (storage.actions_log_prob, storage.advantages, *storage.distribution_params)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(before, after, strict=True))
