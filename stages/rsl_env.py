"""What rsl_rl trains on: the batched MuJoCo environments behind its ``VecEnv``, and its PPO built for them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from rsl_rl.algorithms import PPO
from rsl_rl.env import VecEnv
from tensordict import TensorDict

from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.task import Task
from stages.train_config import TrainConfig


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


def make_env(cfg: TrainConfig, task: Task, twin: PhysicalParams) -> BatchedEnv:
    """The training environments: ``cfg.num_envs`` seeded copies of ``task`` randomized around ``twin``."""
    ranges = cfg.randomization or task.randomization
    return BatchedEnv(task, cfg.num_envs, params=twin, randomization=ranges.around(twin, cfg.twin_intervals),
                      seed=cfg.seed, nthread=cfg.nthread, disturbance=cfg.disturbance, backend=cfg.backend)


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
