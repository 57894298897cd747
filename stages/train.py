"""PPO training with rsl_rl's algorithm on the batched MuJoCo environment.

The loop mirrors rsl_rl's ``OnPolicyRunner.learn`` but reports per-iteration metrics
through a callback, so MLflow and the console stay at the edges. Checkpoints use
rsl_rl's format (``actor_state_dict`` incl. the observation normalizer, ``critic_state_dict``,
``optimizer_state_dict``, ``iter``, ``infos``), so ``OnPolicyRunner.load`` reads them too.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rsl_rl.algorithms import PPO
from rsl_rl.env import VecEnv
from tensordict import TensorDict

from edge.bundle import sha256_path
from stages.artifacts import Checkpoint, atomic_dir
from stages.sim.disturbance import Disturbance
from stages.sim.env import BatchedEnv, NonFiniteTerm
from stages.sim.params import PhysicalParams, Randomization
from stages.sim.registry import load
from stages.sim.task import Task

IterationCallback = Callable[[int, dict[str, float]], None]


class TrainConfig(BaseModel):
    """PPO hyperparameters and the sample budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("cartpole", description="Registered task name or module:Class.")
    iterations: int = Field(30, ge=1, description="PPO iterations (rollout + update).")
    num_envs: int = Field(128, ge=1, description="Parallel simulated environments.")
    steps_per_env: int = Field(32, ge=2, description="Rollout length per environment per iteration.")
    hidden_dims: tuple[int, ...] = Field((64, 64), description="Actor and critic MLP widths.")
    learning_rate: float = Field(1e-3, gt=0)
    entropy_coef: float = Field(0.005, ge=0)
    gamma: float = Field(0.99, gt=0, le=1, description="Discount factor.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    init_noise_std: float = Field(0.6, gt=0, description="Initial std of the Gaussian action noise (normalized units).")
    desired_kl: float = Field(0.01, gt=0, description="Target KL of the adaptive learning-rate schedule.")
    seed: int = Field(0, description="Seeds torch, the environments and the randomization.")
    nthread: int = Field(2, ge=1, description="Physics threads.")
    torch_threads: int = Field(1, ge=1, description="Torch threads for the policy and the PPO update while training: "
                               "the networks are small: one thread matched two on a quiet 2-core machine and was 4× faster "
                               "per update beside a busy one (benchmarks/update_threads.py).")
    eval_every: int = Field(0, ge=0, description="Deterministic evaluation every N iterations (0: never).")
    eval_episodes: int = Field(16, ge=1, description="Episodes per deterministic evaluation (fixed seeds).")
    target_return: Optional[float] = Field(None, description="Stop once a deterministic evaluation reaches this return.")
    minutes: Optional[float] = Field(None, gt=0, description="Wall-clock training budget: the last iteration is the one "
                                                             "after which another would end past it (iterations stays "
                                                             "the cap).")
    checkpoint_every: int = Field(0, ge=0, description="Also write the checkpoint every N iterations (0: at the end).")
    disturbance: Disturbance = Field(default_factory=Disturbance, description="Pushes, sensor bias and initial-state "
                                     "spread during training (e.g. base pushes for a legged robot); none by default.")
    randomization: Optional[Randomization] = Field(None, description="Training's randomization ranges in place of "
                                                   "the task's (``Task.randomization``), e.g. ``latency_steps: 1`` "
                                                   "for a policy that must ride out one more step of delay; still "
                                                   "widened to ``twin_intervals``. None: the task's.")
    twin_intervals: dict[str, tuple[float, float]] = Field(default_factory=dict, description="The twin's 95% "
                                                           "intervals (``TwinSpec.intervals``' keys): training "
                                                           "randomizes over each, widened by the task's own ranges "
                                                           "(``Randomization.around``). Empty: the task's ranges.")
    overlap: bool = Field(False, description="Collect the next rollout while the update runs (one policy lag; "
                                             "not bit-reproducible): collector='thread' by its older name. See "
                                             "benchmarks/overlap.py for when it pays.")
    collector: Literal["sequential", "thread", "process"] = Field("sequential", description="Who collects the "
                                                                  "rollouts: `sequential` before each update (the "
                                                                  "reproducible default); `thread` or `process` the "
                                                                  "next one during the update, with the policy one "
                                                                  "update old (`process`: in a child process, no "
                                                                  "resume or periodic checkpoints).")
    collector_processes: int = Field(1, ge=1, description="With collector='process': how many child processes "
                                     "collect each rollout, each stepping its contiguous slice of num_envs/K "
                                     "environments (seeded seed + slice index; stages/process_sampler.py, "
                                     "benchmarks/collector_scaling.py). Must divide num_envs.")
    backend: Literal["mujoco", "warp"] = Field("mujoco", description="Physics of the training environments: "
                                               "`mujoco` (C MuJoCo, `mujoco.rollout`) or `warp` (MuJoCo Warp on its "
                                               "CPU device, the `warp` extra; slower than C MuJoCo on a CPU, see "
                                               "benchmarks/warp_throughput.py). Evaluation stays on C MuJoCo.")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="Torch device of the networks, the "
                        "rollout storage and the update (`cpu`, `cuda`, `cuda:N`); the physics stays on the CPU. "
                        "Checkpoints load on the CPU wherever they were trained (benchmarks/gpu_check.py).")

    @model_validator(mode="after")
    def _one_collector(self) -> "TrainConfig":
        if self.overlap and self.collector == "process":
            raise ValueError("overlap=True means collector='thread'; give collector alone")
        if self.collector_processes > 1 and self.collector != "process":
            raise ValueError(f"collector_processes={self.collector_processes} needs collector='process' "
                             f"(got collector={self.collector!r}{' with overlap=True' if self.overlap else ''})")
        if self.num_envs % self.collector_processes:
            raise ValueError(f"collector_processes={self.collector_processes} must divide num_envs={self.num_envs}: "
                             "each process steps an equal slice of at least one environment")
        return self


RESUMABLE_CHANGES = frozenset({"iterations", "eval_every", "eval_episodes", "target_return", "checkpoint_every",
                               "nthread", "minutes", "device"})
"""Config fields a resumed run may change; any other difference would make it a different run."""


class NonFiniteTraining(RuntimeError):
    """Training produced NaN/Inf; the last good checkpoint (before the failing iteration) is written."""


@dataclass
class FinishedEpisodes:
    """The episodes that ended since the last :meth:`take`: each one's return, success and length."""

    returns: list[float] = field(default_factory=list)
    success: list[bool] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add(self, more: FinishedEpisodes) -> None:
        self.returns += more.returns
        self.success += more.success
        self.lengths += more.lengths

    def take(self) -> FinishedEpisodes:
        """These episodes, leaving none."""
        taken = FinishedEpisodes(self.returns, self.success, self.lengths)
        self.returns, self.success, self.lengths = [], [], []
        return taken


class RslRlEnv(VecEnv):
    """rsl_rl's VecEnv interface over :class:`BatchedEnv` (numpy in, torch out on ``device``)."""

    def __init__(self, env: BatchedEnv, device: str = "cpu") -> None:
        self.env = env
        self.num_envs = env.num_envs
        self.num_actions = env.task.act_dim
        self.max_episode_length = env.task.episode_steps
        self.device = device
        self.episode_length_buf = torch.zeros(env.num_envs, dtype=torch.long, device=device)
        self.cfg = {"task": env.task.name}
        self._obs = env.observe()
        self._privileged = env.privileged() if env.task.privileged else None
        self.finished = FinishedEpisodes()

    def snapshot(self) -> dict:
        return {"env": self.env.snapshot(), "obs": self._obs.copy()}

    def restore(self, snap: dict) -> None:
        self.env.restore(snap["env"])
        self._obs = snap["obs"].copy()
        self._privileged = self.env.privileged() if self.env.task.privileged else None
        self.episode_length_buf = self._tensor(self.env.episode_step.copy())

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def get_observations(self) -> TensorDict:
        """``policy``: what the actor (and the device) sees; ``privileged``: the critic's simulator-only terms."""
        groups = {"policy": self._tensor(self._obs)}
        if self._privileged is not None:
            groups["privileged"] = self._tensor(self._privileged)
        return TensorDict(groups, batch_size=[self.num_envs], device=self.device)

    def step(self, actions: torch.Tensor):
        r = self.env.step(actions.cpu().numpy())
        self._obs = r.obs
        if self._privileged is not None:
            self._privileged = self.env.privileged()
        self.finished.add(FinishedEpisodes(r.finished_returns.tolist(), r.finished_success.tolist(),
                                           r.finished_lengths.tolist()))
        self.episode_length_buf = self._tensor(self.env.episode_step)
        dones = self._tensor(r.terminated | r.truncated).long()
        extras = {"time_outs": self._tensor(r.truncated).float()}
        return self.get_observations(), self._tensor(r.reward), dones, extras


def rsl_rl_config(cfg: TrainConfig, privileged: bool = False) -> dict:
    """The rsl_rl training config dict for ``cfg``; with ``privileged`` terms the critic also sees them (asymmetric
    actor-critic), the actor never."""
    model = {"class_name": "MLPModel", "hidden_dims": list(cfg.hidden_dims), "activation": "elu", "obs_normalization": True}
    return {
        "num_steps_per_env": cfg.steps_per_env,
        "obs_groups": {"actor": ["policy"], "critic": ["policy", "privileged"] if privileged else ["policy"]},
        "actor": {**model, "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": cfg.init_noise_std}},
        "critic": model,
        "algorithm": {
            "class_name": "PPO",
            "learning_rate": cfg.learning_rate,
            "num_learning_epochs": 5,
            "num_mini_batches": 4,
            "entropy_coef": cfg.entropy_coef,
            "gamma": cfg.gamma,
            "lam": cfg.gae_lambda,
            "desired_kl": cfg.desired_kl,
            "schedule": "adaptive",
        },
        "multi_gpu": None,
    }


def build_algorithm(cfg: TrainConfig, vec_env: RslRlEnv) -> PPO:
    """Construct rsl_rl's PPO (actor, critic, storage) for ``vec_env``, its Adam fused (one kernel per step for all
    parameters instead of several per tensor; see benchmarks/update_threads.py)."""
    alg = PPO.construct_algorithm(vec_env.get_observations(), vec_env,
                                  rsl_rl_config(cfg, bool(vec_env.env.task.privileged)), vec_env.device)
    alg.optimizer = torch.optim.Adam([p for g in alg.optimizer.param_groups for p in g["params"]],
                                     lr=cfg.learning_rate, fused=True)
    return alg


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


def make_env(cfg: TrainConfig, task: Task, twin: PhysicalParams) -> BatchedEnv:
    """The training environments: ``cfg.num_envs`` seeded copies of ``task`` randomized around ``twin``."""
    ranges = cfg.randomization or task.randomization
    return BatchedEnv(task, cfg.num_envs, params=twin, randomization=ranges.around(twin, cfg.twin_intervals),
                      seed=cfg.seed, nthread=cfg.nthread, disturbance=cfg.disturbance, backend=cfg.backend)


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
        self.ready = None
        self._sync()
        if more:
            self._thread = threading.Thread(target=self._background, name="sim2edge-rollout", daemon=True)
            self._thread.start()
        try:
            yield collected
        finally:
            self._join()


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
    equals an uninterrupted run's. Neither it nor ``cfg.checkpoint_every`` works with ``collector='process'``
    (ValueError): the child's environment and its pending rollout are not part of the checkpoint.
    ``evaluate``: what scores the actor every ``eval_every`` iterations (default :func:`deterministic_return`),
    e.g. a benchmark's own fixed episodes. Torch runs on ``cfg.torch_threads`` threads meanwhile (a process-wide
    setting: concurrent trainings in one process each set it and put back what they found)."""
    with torch_threads(cfg.torch_threads):
        if warm_start is not None and resume is not None:
            raise ValueError("give warm_start or resume, not both")
        if cfg.collector == "process" and (resume is not None or cfg.checkpoint_every):
            raise ValueError("collector='process' cannot resume or write periodic checkpoints (its child's environment "
                             "and pending rollout are not saved): use collector='sequential'")
        check_device(cfg.device)
        task = load(cfg.task)
        torch.manual_seed(cfg.seed)
        vec_env = RslRlEnv(make_env(cfg, task, twin), cfg.device)
        alg = build_algorithm(cfg, vec_env)
        if warm_start is not None:
            alg.load(torch.load(warm_start, map_location=cfg.device, weights_only=False), {"actor": True, "critic": True},
                     strict=True)
        first = _resume(alg, vec_env, cfg, twin, resume) if resume is not None else 0
        alg.train_mode()
        last_return = -math.inf
        iterations = cfg.iterations
        if cfg.collector == "process":
            from stages.process_sampler import ProcessSampler  # it imports this module

            sampler: Sampler = ProcessSampler(alg, vec_env, cfg, task, twin)
        else:
            sampler = (OverlappedSampler if cfg.overlap or cfg.collector == "thread" else Sampler)(alg, vec_env, cfg)
        with contextlib.closing(sampler):
            budget_end, iteration_s = time.perf_counter() + 60 * (cfg.minutes or math.inf), 0.0
            for it in range(first, cfg.iterations):
                good = copy.deepcopy(_state(alg, vec_env, twin))  # after the last finite update (normalizer included)
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
                    save_checkpoint(_state(alg, vec_env, twin), it + 1, cfg, out_dir, last_return)
            return save_checkpoint(_state(alg, vec_env, twin), iterations, cfg, out_dir, last_return)


def _state(alg: PPO, vec_env: RslRlEnv, twin: PhysicalParams) -> dict:
    """``PPO.save()`` (rsl_rl's keys) plus what an exact resume needs under ``resume``."""
    rng = {"torch_rng": torch.get_rng_state()}
    if vec_env.device != "cpu":
        rng["cuda_rng"] = torch.cuda.get_rng_state(vec_env.device)
    return {**alg.save(), "resume": {**rng, "twin": twin.model_dump(), **vec_env.snapshot()}}


def _resume(alg: PPO, vec_env: RslRlEnv, cfg: TrainConfig, twin: PhysicalParams, checkpoint: Path) -> int:
    """Load a checkpoint of this run into ``alg`` and ``vec_env``; return the iteration to continue from."""
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
    return int(saved["iter"])


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
