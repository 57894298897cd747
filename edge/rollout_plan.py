"""Which version a device runs while a staged rollout is under way.

A rollout (``sim2edge rollout``) publishes one small signed target per policy, ``<policy>/rollout.json``, in the
TUF repository: the rings in order, each with the version its devices run now, and the version of devices no
ring takes::

    {"policy": "balancer", "rings": [{"name": "canary", "match": {"site": "lab"}, "percent": 5, "version": "7"},
                                     {"name": "all", "match": {}, "percent": null, "version": "6"}],
     "default": "6"}

The device finds its own ring from its id and labels (``--device-id``, ``--label``) — the first ring whose
``match`` labels it carries and whose cumulative ``percent`` covers its bucket, a stable hash of its id — and
pulls that ring's version. A ring under a rollout rate also carries ``admitted``, the share of its devices
(0-100; absent: 100) sent its version so far: a device of the ring whose admission bucket (a second hash of its id,
independent of the first) is below it runs the ring's version, any other the plan's ``default``, as a device in no
ring does (while a ring rolls, ``default`` is the previous version). Advancing a ring, halting it and rolling it
back are each one new ``rollout.json``: the repository directs, the device decides nothing but its own ring. The
file is parsed here strictly (it crossed a trust boundary even though TUF signed it): every refusal names the
field."""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Mapping, NamedTuple, Optional

from edge.errors import CheckFailed
from edge.mqtt_report import LABEL
from edge.values import PolicyName, Version, shown

MAX_BYTES = 64 << 10
MAX_RINGS = 32


class RingPlan(NamedTuple):
    """One ring: the labels it takes (all of them), its cumulative share of the fleet, its version now, and the share
    of its devices (by :func:`admission_bucket`) sent that version so far."""

    name: str
    match: Dict[str, str]
    percent: Optional[float]
    version: Optional[Version]
    admitted: float = 100.0


class RolloutPlan(NamedTuple):
    policy: PolicyName
    rings: List[RingPlan]
    default: Optional[Version]


def bucket(device_id: str) -> float:
    """The device's stable place in [0, 100): the first 8 bytes of SHA-256 of its id."""
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:8], "big") / 2 ** 64 * 100


def admission_bucket(device_id: str) -> float:
    """The device's stable place in [0, 100) in its ring's admission order, independent of :func:`bucket`."""
    return bucket("admission:" + device_id)


def ring_of(device_id: str, labels: Mapping[str, str], rings) -> Optional[str]:
    """The name of the first of ``rings`` (each with ``name``, ``match`` and ``percent``) that takes the device."""
    b = bucket(device_id)
    for ring in rings:
        if all(labels.get(k) == v for k, v in ring.match.items()) and (ring.percent is None or b < ring.percent):
            return ring.name
    return None


def _labels(value: object, field: str) -> Dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) and LABEL.fullmatch(k)
                                              and LABEL.fullmatch(v) for k, v in value.items()):
        raise CheckFailed("rollout", f"{field} {shown(value)} is not a map of labels [a-z0-9_.-]{{1,63}}")
    return dict(value)


def _version(value: object, field: str) -> Optional[Version]:
    return None if value is None else Version.parse(value, field, check="rollout")


def parse_plan(data: bytes, policy: str) -> RolloutPlan:
    """``rollout.json`` of ``policy``; ``CheckFailed("rollout", …)`` naming the first bad field."""
    if len(data) > MAX_BYTES:
        raise CheckFailed("rollout", f"rollout.json is {len(data)} bytes (limit {MAX_BYTES})")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckFailed("rollout", f"rollout.json is not JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict) or set(doc) != {"policy", "rings", "default"}:
        raise CheckFailed("rollout", f"rollout.json must hold exactly policy, rings and default: {shown(doc)}")
    if doc["policy"] != policy:
        raise CheckFailed("rollout", f"rollout.json field policy names {shown(doc['policy'])}, not {policy}")
    rings, seen = [], set()
    if not isinstance(doc["rings"], list) or not 0 < len(doc["rings"]) <= MAX_RINGS:
        raise CheckFailed("rollout", f"rollout.json field rings must be a list of 1-{MAX_RINGS} rings")
    for i, ring in enumerate(doc["rings"]):
        where = f"rollout.json field rings[{i}]"
        if not isinstance(ring, dict) or set(ring) - {"admitted"} != {"name", "match", "percent", "version"}:
            raise CheckFailed("rollout", f"{where} must hold exactly name, match, percent and version "
                                         f"(and optionally admitted): {shown(ring)}")
        name, percent, admitted = ring["name"], ring["percent"], ring.get("admitted", 100.0)
        if not isinstance(name, str) or not LABEL.fullmatch(name) or name in seen:
            raise CheckFailed("rollout", f"{where}.name {shown(name)} is not a new ring name [a-z0-9_.-]{{1,63}}")
        if percent is not None and (isinstance(percent, bool) or not isinstance(percent, (int, float))
                                    or not 0 <= percent <= 100):
            raise CheckFailed("rollout", f"{where}.percent {shown(percent)} is not null or a number in [0, 100]")
        if isinstance(admitted, bool) or not isinstance(admitted, (int, float)) or not 0 <= admitted <= 100:
            raise CheckFailed("rollout", f"{where}.admitted {shown(admitted)} is not a number in [0, 100]")
        seen.add(name)
        rings.append(RingPlan(name, _labels(ring["match"], f"{where}.match"), percent,
                              _version(ring["version"], f"{where}.version"), float(admitted)))
    return RolloutPlan(PolicyName.parse(policy, check="rollout"), rings,
                       _version(doc["default"], "rollout.json field default"))


def version_for(plan: RolloutPlan, device_id: str, labels: Mapping[str, str]) -> Optional[Version]:
    """The version this device runs under ``plan``: its ring's if the ring admitted it, else the default (None:
    nothing for it)."""
    name = ring_of(device_id, labels, plan.rings)
    ring = next((r for r in plan.rings if r.name == name), None)
    return ring.version if ring is not None and admission_bucket(device_id) < ring.admitted else plan.default
