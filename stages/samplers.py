"""Who collects each rollout for the PPO update: in line (``Sampler``) or on a second thread (``OverlappedSampler``);
``stages.process_sampler`` collects in other processes."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from rsl_rl.algorithms import PPO

from stages.rsl_env import RslRlEnv, build_algorithm
from stages.train_config import TrainConfig


def decouple(alg: PPO) -> None:
    """Centre a rollout collected one policy behind (``thread``, ``process``) on the learner's current policy, as
    decoupled PPO does (Hilton et al. 2021, "Batch size-invariance for policy optimization"; AReaL uses it for
    asynchronous RL): the stored log-probabilities and distribution parameters become the current (proximal)
    policy's, the centre of the clip and of the adaptive learning rate's KL, and each advantage is weighted by
    ρ = π_prox(a) / π_behaviour(a). rsl_rl's clipped surrogate on that is the decoupled objective
    min(r·A, clip(r, ρ(1−ε), ρ(1+ε))·A), r = π / π_behaviour. Without it the update starts one update's KL away
    from its centre, and the adaptive schedule keeps cutting the learning rate."""
    storage, actor = alg.storage, alg.actor
    with torch.inference_mode():  # the storage holds inference tensors where collection wrote it in that mode
        actor.distribution.update(actor.mlp(actor.get_latent(storage.observations.flatten(0, 1))))
        proximal = actor.get_output_log_prob(storage.actions.flatten(0, 1)).view_as(storage.actions_log_prob)
        storage.advantages.mul_(torch.exp(proximal - storage.actions_log_prob))
        storage.actions_log_prob.copy_(proximal)
        for stored, current in zip(storage.distribution_params, actor.output_distribution_params, strict=True):
            stored.copy_(current.view_as(stored))


@dataclass(frozen=True)
class Collected:
    seconds: float
    """Wall time of collecting the rollout the update uses (overlapped: collected during the previous update)."""


class Sampler:
    """Collects each rollout into ``alg.storage`` right before its update."""

    def __init__(self, alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig) -> None:
        self.alg, self.vec_env, self.steps = alg, vec_env, cfg.steps_per_env

    def _collect(self, acting: PPO) -> float:
        start = time.perf_counter()
        obs = self.vec_env.get_observations()
        with torch.inference_mode():
            for _ in range(self.steps):
                actions = acting.act(obs)
                obs, rewards, dones, extras = self.vec_env.step(actions)
                acting.process_env_step(obs, rewards, dones, extras)
            acting.compute_returns(obs)
        return time.perf_counter() - start

    @contextlib.contextmanager
    def rollout(self, more: bool) -> Iterator[Collected]:
        """On entry ``alg.storage`` holds a fresh on-policy rollout; the block runs the update."""
        yield Collected(self._collect(self.alg))

    def state(self) -> dict:
        """What a checkpoint needs to continue collection exactly, beside the env's own snapshot: nothing here."""
        return {}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state` of a run with the same config."""

    def close(self) -> None:
        """Release what collection holds (a thread or process); nothing here."""


class OverlappedSampler(Sampler):
    """Collects the next rollout with a copy of the current policy on a second thread while the update runs
    (``collector='thread'``, or ``overlap=True``).

    It pays only where both phases spend their time outside the GIL (physics in C, large networks or a GPU
    update); with small MLPs on 2 cores each phase slows down by what it hides (benchmarks/overlap.py).
    The update learns from data one policy old (PPO's clipped ratio against the stored log-probabilities
    of the acting copy absorbs that); the two threads draw from torch's global RNG in a varying order, so
    a run is not bit-reproducible."""

    def __init__(self, alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig) -> None:
        super().__init__(alg, vec_env, cfg)
        self.acting = build_algorithm(cfg, vec_env)  # its own actor/critic copy and its own storage
        self.acting.train_mode()
        self.ready: Optional[float] = None  # seconds the rollout now in acting.storage took
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _sync(self) -> None:
        self.acting.actor.load_state_dict(self.alg.actor.state_dict())
        self.acting.critic.load_state_dict(self.alg.critic.state_dict())

    def _background(self) -> None:
        try:
            self.ready = self._collect(self.acting)
        except BaseException as e:  # re-raised on the training thread
            self._error = e

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @contextlib.contextmanager
    def rollout(self, more: bool) -> Iterator[Collected]:
        if self.ready is None:  # the first rollout, or the one after an error: collect it now
            self._sync()
            self.ready = self._collect(self.acting)
        collected = Collected(self.ready)
        self.alg.storage, self.acting.storage = self.acting.storage, self.alg.storage
        decouple(self.alg)
        self.ready = None
        self._sync()
        if more:
            self._thread = threading.Thread(target=self._background, name="sim2edge-rollout", daemon=True)
            self._thread.start()
        try:
            yield collected
        finally:
            self._join()
