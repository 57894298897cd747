"""What a training run is: PPO settings, budget, collection, physics backend, randomization (``TrainConfig``)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.sim.disturbance import Disturbance
from stages.sim.params import Randomization


class TrainConfig(BaseModel):
    """PPO hyperparameters and the sample budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("cartpole", description="Registered task name or module:Class.")
    iterations: int = Field(30, ge=1, description="PPO iterations (rollout + update).")
    num_envs: int = Field(128, ge=1, description="Parallel simulated environments.")
    steps_per_env: int = Field(32, ge=2, description="Rollout length per environment per iteration.")
    hidden_dims: tuple[int, ...] = Field((64, 64), min_length=1, description="Actor and critic MLP widths.")
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
    twin_intervals: dict[str, tuple[float, float]] = Field(default_factory=dict, description="The twin's "
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
                                                                  "update old (`process`: in child processes; "
                                                                  "its runs resume exactly too).")
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
