"""Scenario suites: config files (one per task, overridable per run) of what evaluation puts a policy through.

A scenario shifts the twin's physical parameters (scales on damping, actuator gain, armature
and mass; added friction, latency and sensor noise) and disturbs the episode (sensor bias,
pushes, initial-state spread). Each scenario runs ``episodes`` seeded episodes; its floors, when
given, replace the gate's defaults for that scenario.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages.sim.disturbance import Disturbance
from stages.sim.params import PhysicalParams

SUITES = Path(__file__).parent / "suites"
NOMINAL = "nominal"


class Scenario(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9_+%-]+$")
    scale: dict[Literal["damping", "actuator_gain", "armature", "mass"], float] = Field(
        default_factory=dict, description="Multipliers on the twin's calibrated values.")
    extra_friction: float = Field(0.0, ge=0, description="Coulomb friction added on the actuated joints.")
    extra_latency_steps: int = Field(0, ge=0, description="Control steps of action delay added to the twin's.")
    extra_obs_noise: float = Field(0.0, ge=0, description="Sensor noise std added to the twin's.")
    disturbance: Disturbance = Field(default_factory=Disturbance)
    min_success_rate: Optional[float] = Field(None, ge=0, le=1, description="This scenario's success floor.")
    min_mean_return: Optional[float] = Field(None, description="This scenario's return floor.")
    metric_limits: dict[str, float] = Field(default_factory=dict, description="This scenario's limits on task "
                                            "metrics, by name (over the gate's defaults).")

    def params(self, twin: PhysicalParams) -> PhysicalParams:
        """The twin's parameters with this scenario's shifts applied."""
        update = {k: getattr(twin, k) * v for k, v in self.scale.items()}
        return twin.model_copy(update={**update, "friction": twin.friction + self.extra_friction,
                                       "latency_steps": twin.latency_steps + self.extra_latency_steps,
                                       "obs_noise": twin.obs_noise + self.extra_obs_noise})


class Suite(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    episodes: int = Field(32, ge=1, description="Seeded episodes per scenario.")
    scenarios: tuple[Scenario, ...] = Field(min_length=1)

    def model_post_init(self, _: object) -> None:
        names = [s.name for s in self.scenarios]
        if names[0] != NOMINAL:
            raise ValueError(f"the first scenario must be {NOMINAL!r} (the headline numbers), not {names[0]!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"scenario names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")


def suite_path(task: str) -> Path:
    """The task's own suite file, else the generic one."""
    own = SUITES / f"{task}.yaml"
    return own if own.exists() else SUITES / "default.yaml"


def load_suite(path: Path) -> Suite:
    """Read a suite file; errors name the file and the field."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"scenario suite {path}: cannot read it: {e}") from e
    try:
        return Suite.model_validate(data)
    except ValidationError as e:
        fields = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"scenario suite {path}: {fields}") from e
