"""PPO training with rsl_rl's algorithm on the batched MuJoCo environment.

The settings are ``train_config``, the environment and PPO ``rsl_env``, who collects ``samplers``. The loop mirrors
rsl_rl's ``OnPolicyRunner.learn`` but reports per-iteration metrics
through a callback, so MLflow and the console stay at the edges. Checkpoints use
rsl_rl's format (``actor_state_dict`` incl. the observation normalizer, ``critic_state_dict``,
``optimizer_state_dict``, ``iter``, ``infos``), so ``OnPolicyRunner.load`` reads them too.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from rsl_rl.algorithms import PPO
from tensordict import TensorDict

from edge.bundle import sha256_path
from stages.artifacts import Checkpoint, atomic_dir
from stages.process_sampler import ProcessSampler
from stages.rsl_env import RslRlEnv, build_algorithm, make_env, rsl_rl_config
from stages.samplers import OverlappedSampler, Sampler
from stages.sim.env import BatchedEnv, NonFiniteTerm
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.sim.task import Task
from stages.train_config import RESUMABLE_CHANGES, TrainConfig

IterationCallback = Callable[[int, dict[str, float]], None]


class NonFiniteTraining(RuntimeError):
    """Training produced NaN/Inf; the last good checkpoint (before the failing iteration) is written."""


def check_device(device: str) -> None:
    """ValueError in one line when torch cannot use ``device`` here."""
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"train.device {device!r}: torch {torch.__version__} sees no CUDA device here "
                         f"(built with CUDA {torch.version.cuda or 'none'})")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"train.device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``n`` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


EVAL_SEED = 7_000_000
"""Seed of the deterministic evaluation's initial states (disjoint from training seeds)."""


def first_episodes(env: BatchedEnv, policy: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(return, success) of each environment's first episode under ``policy``: (N, obs) → (N, act), clipped to
    [-1, 1]."""
    obs, returns, success = env.observe(), np.full(env.num_envs, np.nan), np.zeros(env.num_envs, bool)
    while np.isnan(returns).any():
        r = env.step(np.clip(policy(obs), -1.0, 1.0))
        finished = np.flatnonzero(r.done)
        fresh = np.isnan(returns[finished])
        returns[finished[fresh]] = r.finished_returns[fresh]
        success[finished[fresh]] = r.finished_success[fresh]
        obs = r.obs
    return returns, success


def deterministic_return(actor: torch.nn.Module, task: Task, twin: PhysicalParams, episodes: int, nthread: int) -> float:
    """Mean return of ``episodes`` seeded episodes (the same ones every call) with the deterministic action."""
    device = next(actor.parameters()).device

    def policy(obs: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return actor(TensorDict({"policy": torch.from_numpy(obs).to(device)}, batch_size=[len(obs)],
                                    device=device)).cpu().numpy()

    returns, _ = first_episodes(BatchedEnv(task, episodes, params=twin, seed=EVAL_SEED, nthread=nthread), policy)
    return float(returns.mean())


def train(
    cfg: TrainConfig,
    twin: PhysicalParams,
    out_dir: Path,
    on_iteration: IterationCallback | None = None,
    warm_start: Path | None = None,
    resume: Path | None = None,
    evaluate: Callable[[torch.nn.Module, Task, PhysicalParams, int, int], float] | None = None,
) -> Checkpoint:
    """Train with randomization centred on ``twin``, over ``cfg.twin_intervals`` where given; write
    ``out_dir/model.pt`` atomically.

    ``warm_start``: start from another checkpoint's actor and critic (fresh optimizer, iteration 0).
    ``resume``: continue a checkpoint of this same run (:data:`RESUMABLE_CHANGES` aside) from its
    iteration up to ``cfg.iterations``, with its optimizer, RNG and environment states: the result
    equals an uninterrupted run's (with ``collector='process'`` too: the checkpoint holds where the children's
    next rollout starts and the weights it is collected with).
    ``evaluate``: what scores the actor every ``eval_every`` iterations (default :func:`deterministic_return`),
    e.g. a benchmark's own fixed episodes. Torch runs on ``cfg.torch_threads`` threads meanwhile (a process-wide
    setting: concurrent trainings in one process each set it and put back what they found)."""
    with torch_threads(cfg.torch_threads):
        if warm_start is not None and resume is not None:
            raise ValueError("give warm_start or resume, not both")
        check_device(cfg.device)
        task = load(cfg.task)
        torch.manual_seed(cfg.seed)
        vec_env = RslRlEnv(make_env(cfg, task, twin), cfg.device)
        alg = build_algorithm(cfg, vec_env)
        if warm_start is not None:
            alg.load(torch.load(warm_start, map_location=cfg.device, weights_only=False), {"actor": True, "critic": True},
                     strict=True)
        first, collection = _resume(alg, vec_env, cfg, twin, resume) if resume is not None else (0, {})
        alg.train_mode()
        last_return = -math.inf
        iterations = cfg.iterations
        if cfg.collector == "process":
            sampler: Sampler = ProcessSampler(alg, vec_env, cfg, task, twin)
        else:
            sampler = (OverlappedSampler if cfg.overlap or cfg.collector == "thread" else Sampler)(alg, vec_env, cfg)
        with contextlib.closing(sampler):
            if collection:
                sampler.restore(collection)
            budget_end, iteration_s = time.perf_counter() + 60 * (cfg.minutes or math.inf), 0.0
            for it in range(first, cfg.iterations):
                good = copy.deepcopy(_state(alg, vec_env, twin, sampler))  # after the last finite update
                start = began = time.perf_counter()
                # the last one: another would end past the budget
                final = it + 1 >= cfg.iterations or began + 2 * iteration_s > budget_end
                try:
                    with sampler.rollout(more=not final) as collect:
                        update_start = time.perf_counter()
                        losses = alg.update()
                        update = time.perf_counter() - update_start
                except NonFiniteTerm as e:  # the task's own term: named, and stopped before it reaches the weights
                    losses = {str(e): math.nan}
                except (ValueError, RuntimeError):  # torch refuses to sample from a NaN mean or std mid-update
                    if all_finite(alg):
                        raise
                    losses = {"parameters": math.nan}
                if not all(math.isfinite(v) for v in losses.values()):
                    ckpt = save_checkpoint(good, it, cfg, out_dir, last_return)
                    raise NonFiniteTraining(f"iteration {it}: training diverged (NaN/Inf in {', '.join(losses)}); the "
                                            f"last good checkpoint (after {it} iterations) is {ckpt.path}")
                done = vec_env.finished.take()
                if done.returns:
                    last_return = float(np.mean(done.returns))
                metrics = {
                    "mean_return": last_return,
                    "success_rate": float(np.mean(done.success)) if done.success else 0.0,
                    "episodes": float(len(done.returns)),
                    "mean_episode_length": float(np.mean(done.lengths)) if done.lengths else math.nan,
                    "env_steps_per_s": cfg.num_envs * cfg.steps_per_env / collect.seconds,
                    "collect_time_s": collect.seconds,
                    "iteration_time_s": time.perf_counter() - start,
                    "update_time_s": update,
                    "sample_time_share": collect.seconds / (collect.seconds + update),
                    **{f"loss_{k}": float(v) for k, v in losses.items()},
                }
                if cfg.eval_every and (it + 1) % cfg.eval_every == 0:
                    start = time.perf_counter()
                    metrics["eval_return"] = (evaluate or deterministic_return)(alg.actor, task, twin,
                                                                                cfg.eval_episodes, cfg.nthread)
                    metrics["eval_time_s"] = time.perf_counter() - start
                if on_iteration:
                    on_iteration(it, metrics)
                iteration_s = time.perf_counter() - began
                if final or (cfg.target_return is not None
                             and metrics.get("eval_return", -math.inf) >= cfg.target_return):
                    iterations = it + 1
                    break
                if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0 and it + 1 < cfg.iterations:
                    save_checkpoint(_state(alg, vec_env, twin, sampler), it + 1, cfg, out_dir, last_return)
            return save_checkpoint(_state(alg, vec_env, twin, sampler), iterations, cfg, out_dir, last_return)


def _state(alg: PPO, vec_env: RslRlEnv, twin: PhysicalParams, sampler: Sampler) -> dict:
    """``PPO.save()`` (rsl_rl's keys) plus what an exact resume needs under ``resume``."""
    rng = {"torch_rng": torch.get_rng_state()}
    if vec_env.device != "cpu":
        rng["cuda_rng"] = torch.cuda.get_rng_state(vec_env.device)
    return {**alg.save(), "resume": {**rng, "twin": twin.model_dump(), **vec_env.snapshot(),
                                     "collection": sampler.state()}}


def _resume(alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig, twin: PhysicalParams, checkpoint: Path) -> tuple[int, dict]:
    """Load a checkpoint of this run into ``alg`` and ``vec_env``; return the iteration to continue from and the
    collector's state (:meth:`stages.samplers.Sampler.state`)."""
    saved = torch.load(checkpoint, map_location=cfg.device, weights_only=False)
    if "resume" not in saved:
        raise ValueError(f"{checkpoint} holds no resume state (not written by sim2edge's train); warm-start from it")
    old = {**TrainConfig().model_dump(mode="json"), **saved["infos"]["config"]}  # a field added since: its default
    changed = sorted(k for k, v in cfg.model_dump(mode="json").items() if k not in RESUMABLE_CHANGES and old.get(k) != v)
    if changed:
        raise ValueError(f"{checkpoint} was trained with a different config: "
                         + ", ".join(f"{k} {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed))
    if saved["resume"]["twin"] != twin.model_dump():
        raise ValueError(f"{checkpoint} was trained around a different twin: {saved['resume']['twin']} vs "
                         f"{twin.model_dump()}")
    if saved["iter"] >= cfg.iterations:
        raise ValueError(f"{checkpoint} already has {saved['iter']} iterations; iterations={cfg.iterations} adds none")
    alg.load(saved, {"actor": True, "critic": True, "optimizer": True}, strict=True)
    vec_env.restore(saved["resume"])
    torch.set_rng_state(saved["resume"]["torch_rng"].cpu())
    if vec_env.device != "cpu" and "cuda_rng" in saved["resume"]:
        torch.cuda.set_rng_state(saved["resume"]["cuda_rng"].cpu(), vec_env.device)
    return int(saved["iter"]), saved["resume"].get("collection", {})


def all_finite(alg: PPO) -> bool:
    """Whether every weight and normalizer statistic of the actor and critic is finite."""
    tensors = [*alg.actor.state_dict().values(), *alg.critic.state_dict().values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def save_checkpoint(state: dict, iterations: int, cfg: TrainConfig, out_dir: Path, final_return: float) -> Checkpoint:
    """Write ``state`` (``PPO.save()``) as ``out_dir/model.pt`` in rsl_rl's format, atomically."""
    infos = {"task": cfg.task, "hidden_dims": list(cfg.hidden_dims), "config": cfg.model_dump(mode="json")}
    with atomic_dir(out_dir) as tmp:
        torch.save({**state, "iter": iterations, "infos": infos}, tmp / "model.pt")
    path = out_dir / "model.pt"
    return Checkpoint(path=path, digest=sha256_path(path), task=cfg.task, iterations=iterations,
                      final_return=final_return, hidden_dims=cfg.hidden_dims)


def load_actor(checkpoint: Path) -> torch.nn.Module:
    """Rebuild the trained actor (with its normalizer) on the CPU from an rsl_rl-format checkpoint."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    cfg = TrainConfig(**saved["infos"]["config"])
    task = load(cfg.task)
    obs = TensorDict({"policy": torch.zeros(1, task.obs_dim)}, batch_size=[1])
    model_cfg = rsl_rl_config(cfg)["actor"]
    from rsl_rl.models import MLPModel

    actor = MLPModel(obs, {"actor": ["policy"]}, "actor", task.act_dim,
                     hidden_dims=model_cfg["hidden_dims"], activation=model_cfg["activation"],
                     obs_normalization=True, distribution_cfg=model_cfg["distribution_cfg"])
    actor.load_state_dict(saved["actor_state_dict"])
    return actor.eval()
