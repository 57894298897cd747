"""The policy's I/O contract as a typed spec: observation and action terms, limits, scale, control period.

A registered task gives one (:meth:`IOSpec.from_task`); an external policy brings one as a YAML or
JSON file (:meth:`IOSpec.from_file`). The bundle manifest's ``io`` and ``control`` come from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import mujoco
import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_SYMBOL = r"(?:(?:[nuµmckM]?(?:m|s|g|N|A|V|W|J|K|Pa|Hz|rad))|deg|°|rpm|%)(?:\^-?\d)?"
UNIT = re.compile(rf"^(?:1|{_SYMBOL}(?:[ ·*/]{_SYMBOL})*)$")
"""A unit: ``1`` (dimensionless) or SI symbols (with a prefix, an integer power) joined by space, ``·``, ``*`` or
``/`` (``m/s``, ``N m``, ``rad/s^2``, ``mA``); a factor such as ``N/10`` is a number, not part of the unit."""


def _unit(value: str) -> str:
    if not UNIT.fullmatch(value):
        raise ValueError(f"unit {value!r} is not a unit: write factors as numbers (an action's scale or gear) "
                         f"and the unit alone, e.g. 'N', 'N m', 'm/s', '1'")
    return value


class ObservationTerm(BaseModel):
    """One observed quantity in ``unit`` (a unit, e.g. ``m/s``; ``1`` for dimensionless), minus ``offset`` when set."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    unit: str = "1"
    offset: float | None = Field(None, description="The term is the measurement minus this (e.g. a joint angle "
                                                   "from the standing pose), in `unit`.")
    _unit = field_validator("unit")(_unit)
    low: float | None = Field(None, description="Expected range (documentation and parity inputs), not enforced.")
    high: float | None = None
    source: Literal["command"] | None = Field(None, description="`command`: the robot's software provides it (a goal "
                                                               "or command), no sensor measures it; unset: measured.")


class ActionTerm(BaseModel):
    """One actuator command: ``default + scale * raw`` (raw clipped to ±clip when set), then kept in [low, high].

    ``low``, ``high``, ``default`` and ``scale`` are in output units; the physical command is ``gear`` × output
    in ``unit`` (a cart-pole motor with gear 10: output 0.5 is 5 N)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    unit: str = "1"
    low: float
    high: float
    default: float = 0.0
    scale: float = 1.0
    gear: float = Field(1.0, gt=0, description="Physical command in `unit` per unit of output (a MuJoCo motor's "
                                               "gear × gain; 1 when the output is already in `unit`).")
    _unit = field_validator("unit")(_unit)

    @model_validator(mode="after")
    def _ordered(self) -> "ActionTerm":
        if not self.low < self.high:
            raise ValueError(f"action {self.name!r}: low {self.low} must be below high {self.high}")
        if not self.low <= self.default <= self.high:
            raise ValueError(f"action {self.name!r}: default {self.default} is outside [{self.low}, {self.high}]")
        return self


class IOSpec(BaseModel):
    """What the device needs to know to feed the policy and use its output."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("external", description="A registered task (evaluation in its twin) or a free name.")
    observations: tuple[ObservationTerm, ...] = Field(min_length=1)
    actions: tuple[ActionTerm, ...] = Field(min_length=1)
    control_period_s: float = Field(gt=0)
    physics_dt_s: float | None = Field(None, gt=0)
    decimation: int | None = Field(None, ge=1)
    raw_action_clip: float | None = Field(None, gt=0, description="Clip the network's raw action to ±this first.")
    activation: Literal["elu", "relu", "selu", "tanh", "leaky_relu", "gelu", "silu"] = Field(
        "elu", description="Hidden-layer activation of an rsl_rl checkpoint's MLP (Isaac Lab's default: elu).")

    @property
    def obs_dim(self) -> int:
        return len(self.observations)

    @property
    def act_dim(self) -> int:
        return len(self.actions)

    def action_array(self, field: str) -> np.ndarray:
        return np.array([getattr(a, field) for a in self.actions], np.float32)

    @classmethod
    def from_file(cls, path: Path) -> "IOSpec":
        """Read a YAML (``.yaml``/``.yml``) or JSON spec; errors name the file and the field."""
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: cannot read the I/O spec ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the I/O spec must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(map(str, first["loc"])) or "(top level)"
            raise ValueError(f"{path}: {loc}: {first['msg']} (got {first.get('input')!r})") from None

    @classmethod
    def from_task(cls, task) -> "IOSpec":
        """The spec of a registered task (its terms, offsets, actuator ranges and gears, default pose, scale, rates)."""
        low, high = task.model.actuator_ctrlrange.T
        offsets = np.asarray(task.observation_offsets(), np.float64).tolist()
        return cls(task=task.name,
                   observations=[ObservationTerm(name=o.name, unit=o.unit, offset=off or None,
                                                 source="command" if o.source == "command" else None)
                                 for o, off in zip(task.observations, offsets)],
                   actions=[ActionTerm(name=a.name, unit=a.unit, low=lo, high=hi, default=d, scale=s, gear=g)
                            for a, lo, hi, d, s, g in zip(task.actions, low.tolist(), high.tolist(),
                                                          np.asarray(task.action_default).tolist(),
                                                          np.asarray(task.action_scale).tolist(), actuator_gears(task.model))],
                   control_period_s=float(task.ctrl_dt), physics_dt_s=float(task.model.opt.timestep), decimation=int(task.decimation),
                   raw_action_clip=1.0)

    def manifest_io(self, input_name: str, output_name: str, batch: int = -1) -> dict:
        """The manifest's ``io`` section (``batch`` -1: dynamic)."""
        return {
            "input": {"name": input_name, "shape": [batch, self.obs_dim], "dtype": "float32",
                      "terms": [o.model_dump(exclude_none=True) for o in self.observations]},
            "output": {"name": output_name, "shape": [batch, self.act_dim], "dtype": "float32",
                       "terms": [{"name": a.name, "unit": a.unit} for a in self.actions],
                       "low": [a.low for a in self.actions], "high": [a.high for a in self.actions],
                       "default": [a.default for a in self.actions], "scale": [a.scale for a in self.actions],
                       "gear": [a.gear for a in self.actions], "raw_action_clip": self.raw_action_clip},
        }

    def manifest_control(self) -> dict:
        return {"period_s": self.control_period_s, "physics_dt_s": self.physics_dt_s, "decimation": self.decimation}

    def unsaturated(self, actions: np.ndarray) -> np.ndarray:
        """(B, act_dim) bool: which of the (B, act_dim) ``actions`` have their raw value inside the clip."""
        if self.raw_action_clip is None:
            return np.ones(np.shape(actions), bool)
        raw = (actions - self.action_array("default")) / self.action_array("scale")
        return np.abs(raw) < self.raw_action_clip * (1 - 1e-6)


def actuator_gears(model) -> list[float]:
    """Per actuator of a MuJoCo model, the physical command per unit of ctrl: gear × gain for a motor (force or
    torque), 1 / gear for a servo (a position setpoint of gear × q)."""
    motor = model.actuator_biastype == mujoco.mjtBias.mjBIAS_NONE
    gear, gain = model.actuator_gear[:, 0], model.actuator_gainprm[:, 0]
    return np.where(motor, gear * gain, 1.0 / gear).tolist()
