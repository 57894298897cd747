"""How calibration runs: replay windows, CMA-ES budgets, the per-joint prior, misfit threshold and bootstrap size."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from stages.sim.task import Task


def _odd_window(v: int) -> int:
    if v < 1 or v % 2 == 0 or v == 3:
        raise ValueError(f"start_smoothing must be 1 or an odd window of at least 5 samples, not {v}")
    return v


SensorWeight = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A sensor's weight in the calibration residual: a finite positive number."""

SmoothingWindow = Annotated[int, AfterValidator(_odd_window)]
"""A Savitzky-Golay window: 1 (raw) or odd ≥ 5; in the type, so the pipeline's settings check it too."""


class CalibrateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    window: int = Field(20, ge=2, description="Replay window length in control steps.")
    joint_window: Optional[int] = Field(None, ge=2, description="Replay window of the per-joint pass in control steps "
                                        "(default: the task's `joint_window`, else window). Longer windows carry more "
                                        "of a small friction.")
    max_windows: int = Field(192, ge=1, description="Windows sampled from the dataset.")
    generations: int = Field(40, ge=1, description="CMA-ES generations for the chosen latency.")
    search_generations: int = Field(8, ge=1, description="CMA-ES generations per latency candidate.")
    max_latency: int = Field(3, ge=0, description="Largest actuation latency tried, in control steps.")
    population: int = Field(8, ge=4)
    min_sensitivity: float = Field(0.02, ge=0, description="A 10% change must raise the replay error by this fraction, "
                                                          "else the parameter is unidentifiable.")
    joint_generations: int = Field(80, ge=0, description="CMA-ES generations of the per-joint search that runs where "
                                   "the Levenberg-Marquardt fit leaves a misfit (0: never).")
    joint_steps: int = Field(24, ge=0, description="Levenberg-Marquardt trial steps of the per-joint fit (0: global "
                                                  "only).")
    prior_width: float = Field(0.3, gt=0, description="1σ of the per-joint log-multipliers' prior around the global fit.")
    groups: dict[str, tuple[str, ...]] = Field(default_factory=dict, description="Joints that share hardware, "
                                               "fitted as one multiplier: {group name: joint names}.")
    body_masses: bool = Field(False, description="Also fit a mass multiplier per mass body in the per-joint pass (with "
                                                 "several mass bodies, whether or not the global mass is identified). "
                                                 "Off by default: on arm6's per-joint stand-in three of six links' "
                                                 "intervals still miss their truth.")
    joint_armature: bool = Field(False, description="Also fit an armature multiplier per joint (with a nonzero datasheet "
                                 "armature) in the per-joint pass. Off by default: without gravity or coupled link "
                                 "inertia a joint's armature trades against its gain and damping (the planar reacher).")
    servo_kv: bool = Field(False, description="Also fit a velocity-gain (kv) multiplier per position servo that has "
                           "one, apart from its gain (kp), in the per-joint pass. Off by default: below the servo's "
                           "force limit kv acts as joint damping does, so only saturated steps tell them apart.")
    misfit_ratio: float = Field(2.0, gt=1, description="Replay error over the noise floor above which the twin "
                                                       "reports a misfit.")
    bootstrap: int = Field(2000, ge=20, description="Episode resamples of the bootstrap intervals: each tail of one of "
                           "six that hold together at 95% (the per-joint reacher's) keeps 0.43% of them.")
    start_draws: int = Field(32, ge=2, description="Noise draws on the replays' start states whose refits measure "
                                                   "what that noise does to the fit: its spread, and in the per-joint "
                                                   "fit its bias (intervals.start_spread).")
    start_smoothing: Optional[SmoothingWindow] = Field(None, description="Window (samples, odd) of the quadratic "
                                           "Savitzky-Golay filter over the logged joint states a replay starts from; "
                                           "1: raw; default: the task's (`start_smoothing`: 5 for the quadruped).")
    fit_starts: Optional[bool] = Field(None, description="Fit each per-joint replay window's start state (the robot's "
                                       "hinge and slide joints) with the parameters instead of taking the logged one "
                                       "as exact (stages.twin.starts); with a long joint_window it recovers a small "
                                       "friction. Default: the task's (`fit_starts`: on for the reacher).")
    sensors: dict[str, SensorWeight] = Field(default_factory=dict, description="Sensors in the residual: {sensor "
                                             "name: weight}. The replayed reading minus the logged one (the observation "
                                             "terms that read it, Term.sensor) counts weight × its unit against rad of "
                                             "joint position; weight = joint noise / sensor noise weighs them alike.")
    seed: int = 0
    nthread: int = 2

    def for_task(self, task: Task) -> CalibrateConfig:
        """This configuration with ``task``'s defaults where it leaves them open (``joint_window``, ``fit_starts``)."""
        return self.model_copy(update={"joint_window": self.joint_window or task.joint_window,
                                       "fit_starts": task.fit_starts if self.fit_starts is None else self.fit_starts})
