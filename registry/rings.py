"""Rollout rings: which ring a device is in, from its labels (``sim2edge-agent --label``) and a ring spec.

Rings are ordered (the first is rolled out first). A device is in the first ring whose ``match``
labels it carries, all of them, and whose ``percent`` covers its bucket: a stable hash of the device
id onto [0, 100), so a device keeps its ring across reports, restarts and fleets. Percentages are
cumulative — ``canary`` 5 then ``early`` 25 takes the next 20 % — and a ring without ``percent``
takes every matching device left. A device no ring takes is in none (``None``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge.mqtt_report import LABEL
from edge.rollout_plan import ring_of as device_ring


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """``labels`` unchanged if every key and value is 1-63 characters ``[a-z0-9_.-]``; ValueError naming the first
    that is not."""
    for key, value in labels.items():
        if not LABEL.fullmatch(key) or not LABEL.fullmatch(value):
            raise ValueError(f"label {key}={value!r}: keys and values are 1-63 characters [a-z0-9_.-]")
    return labels


class Ring(BaseModel):
    """One ring: ``match`` labels (all required; none: any device) and a cumulative ``percent`` of the fleet."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9_.-]{1,63}$")
    match: dict[str, str] = {}
    percent: Optional[float] = Field(None, ge=0, le=100)

    @field_validator("match")
    @classmethod
    def _labels(cls, match: dict[str, str]) -> dict[str, str]:
        return check_labels(match)


class RingSpec(BaseModel):
    """The rings in rollout order; names unique."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rings: list[Ring] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "RingSpec":
        names = [r.name for r in self.rings]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ValueError(f"ring {dup!r} is named twice")
        return self

    @classmethod
    def load(cls, path) -> "RingSpec":
        """A YAML file ``rings: [{name, match, percent}, …]``."""
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))


def ring_of(device_id: str, labels: dict[str, str], spec: RingSpec) -> Optional[str]:
    """The name of the first ring that takes the device (see the module docstring), or None; the device computes
    its own ring with the same function (edge/rollout_plan.py)."""
    return device_ring(device_id, labels, spec.rings)


def assign(devices: dict[str, dict[str, str]], spec: RingSpec) -> dict[str, Optional[str]]:
    """Every device id of ``devices`` (id → labels) with its ring."""
    return {d: ring_of(d, labels, spec) for d, labels in devices.items()}
