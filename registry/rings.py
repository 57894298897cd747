"""Rollout rings: which ring a device is in, from its labels (``sim2edge-agent --label``) and a ring spec.

Rings are ordered (the first is rolled out first). A device is in the first ring whose ``match``
labels it carries, all of them, and whose ``percent`` covers its bucket: a stable hash of the device
id onto [0, 100), so a device keeps its ring across reports, restarts and fleets. Percentages are
cumulative — ``canary`` 5 then ``early`` 25 takes the next 20 % — and a ring without ``percent``
takes every matching device left. A device no ring takes is in none (``None``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge.mqtt_report import LABEL


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


def bucket(device_id: str) -> float:
    """The device's stable place in [0, 100): the first 8 bytes of SHA-256 of its id."""
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big") / 2 ** 64 * 100


def ring_of(device_id: str, labels: dict[str, str], spec: RingSpec) -> Optional[str]:
    """The name of the first ring that takes the device (see the module docstring), or None."""
    b = bucket(device_id)
    for ring in spec.rings:
        if all(labels.get(k) == v for k, v in ring.match.items()) and (ring.percent is None or b < ring.percent):
            return ring.name
    return None


def assign(devices: dict[str, dict[str, str]], spec: RingSpec) -> dict[str, Optional[str]]:
    """Every device id of ``devices`` (id → labels) with its ring."""
    return {d: ring_of(d, labels, spec) for d, labels in devices.items()}
