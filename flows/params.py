"""Typed flow parameters: the Prefect UI renders these as a form and refuses invalid values."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edge.targets import load_target
from stages.sim.disturbance import Disturbance
from stages.sim.params import Randomization
from stages.sim.registry import load, names
from stages.artifacts import ScenarioResult
from stages.train_config import TrainConfig
from stages.twin.calibration_config import CalibrateConfig, SensorWeight, SmoothingWindow
from stages.twin.gate import Check, GateConfig, check_metric_names
from stages.twin.hil_stage import HilSettings


def field_of(model: type[BaseModel], name: str):
    """The field of ``model`` called ``name``, for a settings model that exposes it: one default, one description and
    one set of constraints for both."""
    return model.model_fields[name]


class TrainSettings(BaseModel):
    """PPO settings of a pipeline run (the rest of :class:`stages.train_config.TrainConfig` comes from the run itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    steps_per_env: int = field_of(TrainConfig, "steps_per_env")
    hidden_dims: tuple[int, ...] = field_of(TrainConfig, "hidden_dims")
    learning_rate: float = field_of(TrainConfig, "learning_rate")
    entropy_coef: float = field_of(TrainConfig, "entropy_coef")
    gamma: float = field_of(TrainConfig, "gamma")
    gae_lambda: float = field_of(TrainConfig, "gae_lambda")
    init_noise_std: float = field_of(TrainConfig, "init_noise_std")
    desired_kl: float = field_of(TrainConfig, "desired_kl")
    collector: Literal["sequential", "thread", "process"] = field_of(TrainConfig, "collector")
    collector_processes: int = field_of(TrainConfig, "collector_processes")
    minutes: Optional[float] = Field(None, gt=0, description="Wall-clock training budget per seed; `iterations` stays "
                                                             "the cap.")
    randomization: Optional[Randomization] = Field(None, description="Randomization ranges in place of the task's, "
                                                   "still widened to the twin's intervals (e.g. `latency_steps: 1` to "
                                                   "ride out one more step of delay). None: the task's.")
    disturbance: Disturbance = Field(
        default_factory=lambda: Disturbance(init_spread=2.0),
        description="Disturbances during training. The default doubles the initial-state spread, as the suites' "
                    "init-spread-x2 scenario does; trained without it, cart-pole passed that scenario 21/32 (lower "
                    "bound 0.48 < 0.5).")


class CalibrateSettings(BaseModel):
    """Calibration settings of a pipeline run (the seed is the run's; see :class:`CalibrateConfig`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    window: int = field_of(CalibrateConfig, "window")
    max_windows: int = field_of(CalibrateConfig, "max_windows")
    generations: int = field_of(CalibrateConfig, "generations")
    search_generations: int = field_of(CalibrateConfig, "search_generations")
    max_latency: int = field_of(CalibrateConfig, "max_latency")
    joint_steps: int = field_of(CalibrateConfig, "joint_steps")
    joint_generations: int = field_of(CalibrateConfig, "joint_generations")
    groups: dict[str, tuple[str, ...]] = field_of(CalibrateConfig, "groups")
    bootstrap: int = field_of(CalibrateConfig, "bootstrap")
    start_smoothing: Optional[SmoothingWindow] = field_of(CalibrateConfig, "start_smoothing")
    sensors: dict[str, SensorWeight] = field_of(CalibrateConfig, "sensors")
    fit_starts: Optional[bool] = field_of(CalibrateConfig, "fit_starts")
    joint_window: Optional[int] = field_of(CalibrateConfig, "joint_window")
    body_masses: bool = field_of(CalibrateConfig, "body_masses")
    joint_armature: bool = field_of(CalibrateConfig, "joint_armature")
    servo_kv: bool = field_of(CalibrateConfig, "servo_kv")


class PublishSettings(BaseModel):
    """Where a new champion goes for the fleet (registry/tuf_repo.py). (No field may be named ``keys``: Prefect
    resolves a parameter model's inputs through ``.keys()``.)"""

    model_config = ConfigDict(frozen=True, extra="forbid")
    repo: str = Field(min_length=1, description="TUF repository directory (static files the devices' server serves).")
    key_dir: Optional[str] = Field(None, description="Its role keys (default: <workspace>/tuf-keys; never served).")


TASK_REFERENCE = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""A task as ``module:Class`` in a deployment's parameter schema, beside the registered names the UI picks from: Prefect
checks a run's parameters against the schema before the flow's own validator sees them."""


class PipelineParams(BaseModel):
    """What every pipeline flow takes: task, target, training budget, evaluation and gates."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("cartpole", description="Registered task (`sim2edge tasks`), or a user's own task as "
                      "module:Class (importable where the flow runs, e.g. on the worker).",
                      json_schema_extra={"anyOf": [{"enum": names()}, {"pattern": TASK_REFERENCE}]})
    target: str = Field("orin-jp6.1", description="Jetson target profile (`sim2edge targets`).")
    iterations: int = Field(100, ge=1, le=100000, description="PPO iterations.")
    num_envs: int = Field(128, ge=1, le=16384, description="Parallel simulated environments in training.")
    train: TrainSettings = Field(default_factory=TrainSettings, description="PPO settings (a task's preset sets them: "
                                                                           "`sim2edge tasks --show TASK`).")
    calibrate: CalibrateSettings = Field(default_factory=CalibrateSettings, description="Twin calibration budget "
                                         "(fewer generations or windows: faster, rougher).")
    seed: int = Field(0, description="Seed for collection, calibration, training and evaluation.")
    train_seeds: int = Field(1, ge=1, le=64, description="Independent PPO runs (seed, seed+1, …) fanned out over the "
                                                        "task runner; the best final training return is exported.")
    eval_episodes: int = Field(32, ge=1, description="Seeded evaluation episodes per scenario of the suite.")
    gate: GateConfig = Field(default_factory=GateConfig, description="Floors the policy must clear.")
    promote: bool = Field(True, description="Set `champion` when the gate passes (else always `challenger`).")
    hil: Optional[HilSettings] = Field(None, description="Hardware-in-the-loop evaluation of the packaged bundle before "
                                       "register (None: none); a failing HIL gate keeps the version a `challenger`.")
    publish: Optional[PublishSettings] = Field(None, description="Publish a new champion's bundle to this TUF "
                                               "repository after register (None: none); devices `watch --tuf` it.")
    model_prefix: str = Field("", pattern=r"^[A-Za-z0-9_.-]*$", max_length=64,
                              description="Prefix of the registered model's name (`<prefix><task>`, e.g. `lab-a.`), "
                                          "so pipelines sharing one registry do not collide.")

    @property
    def policy_name(self) -> str:
        """The registered model's name: the prefix and the task's own name (also for a ``module:Class`` task)."""
        return self.model_prefix + load(self.task).name

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        try:
            load(v)
        except (KeyError, ImportError, AttributeError, ValueError) as e:
            raise ValueError(str(e).strip('"')) from None
        return v

    @field_validator("target")
    @classmethod
    def _known_target(cls, v: str) -> str:
        try:
            load_target(v)
        except KeyError as e:
            raise ValueError(str(e).strip('"')) from None
        return v

    @model_validator(mode="after")
    def _sensors_the_task_reads(self) -> "PipelineParams":
        unread = load(self.task).unread_sensors(self.calibrate.sensors)
        if unread:
            raise ValueError(f"calibrate.sensors: {unread[0]}")
        return self

    @model_validator(mode="after")
    def _collectors_split_the_envs(self) -> "PipelineParams":
        k = self.train.collector_processes
        try:  # TrainConfig's own check, named by this run's keys
            TrainConfig(num_envs=self.num_envs, collector=self.train.collector, collector_processes=k)
        except ValidationError:
            raise ValueError(f"train.collector_processes: {k} needs train.collector 'process' and must divide "
                             f"num_envs {self.num_envs} (got collector {self.train.collector!r})") from None
        return self

    @model_validator(mode="after")
    def _metrics_the_task_has(self) -> "PipelineParams":
        check_metric_names(self.gate.metric_limits, load(self.task))
        return self


class SimToEdgeParams(PipelineParams):
    """One run of the whole chain for one task and target, calibrated on fresh stand-in logs (or on a dataset version
    already collected, e.g. from a robot's rosbag)."""

    collect_episodes: int = Field(16, ge=1, description="Stand-in episodes to record for calibration.")
    dataset_version: Optional[int] = Field(None, ge=1, description="Calibrate on this version of the task's dataset, "
                                           "already collected (`sim2edge collect`, e.g. `--source rosbag`), instead of "
                                           "recording fresh stand-in logs (None: record them).")


class NightlyParams(PipelineParams):
    """Nightly retraining: new telemetry → recalibrate → warm-start from the champion → gate → package."""

    iterations: int = Field(30, ge=1, le=100000, description="PPO iterations of fine-tuning from the champion.")
    source: Literal["registry", "folder"] = Field("registry", description="Where devices' telemetry arrives.")
    folder: Optional[str] = Field(None, description="Telemetry folder when source is `folder`.")
    no_new_data: Literal["skip", "retrain"] = Field(
        "skip", description="With no telemetry since the last watermark: skip the run, or retrain anyway.")
    warm_start: bool = Field(True, description="Start training from the champion's checkpoint (else from scratch).")


class PipelineSummary(BaseModel):
    policy: str
    version: str
    alias: str
    success_rate: float
    mean_return: float
    gate_reasons: tuple[str, ...]
    gate_checks: tuple[Check, ...] = ()
    """The same clauses, structured (the evaluation report's ``checks``)."""
    hil_checks: tuple[Check, ...] = ()
    """The HIL gate's clauses (empty: no HIL stage)."""
    bundle_sha256: str
    mlflow_run_id: str
    tracking_uri: str
    pull_command: str
    stage_seconds: dict[str, float]
    dataset_version: int = 0
    warm_started_from: Optional[str] = None
    compared_with: Optional[str] = None
    champion_mean_return: Optional[float] = None
    champion_success_rate: Optional[float] = None
    mlflow_experiment_id: str = ""
    scenarios: tuple[ScenarioResult, ...] = ()
    sim_to_real_gap: Optional[dict[str, float]] = None
