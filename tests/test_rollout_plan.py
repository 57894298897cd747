"""The device's reading of a rollout plan (edge/rollout_plan.py): its ring from its id and labels, the ring's
version, and a one-line refusal naming the field of a plan that is not one."""

from __future__ import annotations

import json

import pytest

from edge.errors import CheckFailed
from edge.rollout_plan import admission_bucket, bucket, parse_plan, version_for
from registry.rings import RingSpec, ring_of

PLAN = {"policy": "tiny", "default": "3",
        "rings": [{"name": "canary", "match": {}, "percent": 10, "version": "5"},
                  {"name": "lab", "match": {"site": "lab"}, "percent": None, "version": "4"}]}


def parsed(**changes):
    return parse_plan(json.dumps({**PLAN, **changes}).encode(), "tiny")


def test_each_device_runs_its_rings_version_as_the_fleet_side_places_it():
    ids = [f"dev-{i}" for i in range(400)]
    plan = parsed()
    spec = RingSpec.model_validate({"rings": [{k: r[k] for k in ("name", "match", "percent")} for r in PLAN["rings"]]})
    versions = {"canary": "5", "lab": "4", None: "3"}
    for i, d in enumerate(ids):
        labels = {"site": "lab"} if i % 2 else {"site": "field"}
        assert version_for(plan, d, labels) == versions[ring_of(d, labels, spec)]
    canary = sum(bucket(d) < 10 for d in ids)
    assert 20 <= canary <= 60  # ~10 % of 400
    assert version_for(parsed(default=None), next(d for d in ids if bucket(d) >= 10), {}) is None


@pytest.mark.parametrize("changes,named", [
    ({"policy": "other"}, "field policy names 'other'"),
    ({"extra": 1}, "exactly policy, rings and default"),
    ({"default": "v3"}, "field default 'v3' is not a positive version"),
    ({"rings": []}, "field rings must be a list of 1-32"),
    ({"rings": [{**PLAN["rings"][0], "percent": 101}]}, "rings[0].percent 101"),
    ({"rings": [{**PLAN["rings"][0], "percent": True}]}, "rings[0].percent True"),
    ({"rings": [PLAN["rings"][0], PLAN["rings"][0]]}, "rings[1].name 'canary' is not a new ring name"),
    ({"rings": [{**PLAN["rings"][1], "match": {"Site": "lab"}}]}, "rings[0].match {'Site': 'lab'}"),
    ({"rings": [{**PLAN["rings"][0], "version": -1}]}, "rings[0].version '-1'"),
    ({"rings": [{"name": "x", "match": {}}]}, "rings[0] must hold exactly name, match, percent and version"),
    ({"rings": [{**PLAN["rings"][0], "admitted": 100.5}]}, "rings[0].admitted 100.5 is not a number in [0, 100]"),
    ({"rings": [{**PLAN["rings"][0], "admitted": -1}]}, "rings[0].admitted -1"),
    ({"rings": [{**PLAN["rings"][0], "admitted": True}]}, "rings[0].admitted True"),
    ({"rings": [{**PLAN["rings"][0], "admitted": "50"}]}, "rings[0].admitted '50'"),
    ({"rings": [{**PLAN["rings"][0], "admitted": None}]}, "rings[0].admitted None"),
    ({"rings": [{**PLAN["rings"][0], "admitted": float("nan")}]}, "rings[0].admitted nan"),
], ids=lambda v: str(v)[:40])
def test_a_bad_plan_is_refused_naming_its_field(changes, named):
    with pytest.raises(CheckFailed) as e:
        parsed(**changes)
    assert e.value.check == "rollout" and named in e.value.detail, e.value.detail


def test_a_plan_that_is_not_json_or_too_large_is_refused():
    for data, named in ((b"{", "not JSON"), (b" " * (65 << 10), "bytes (limit")):
        with pytest.raises(CheckFailed, match=r"rollout") as e:
            parse_plan(data, "tiny")
        assert named in e.value.detail


def test_a_device_outside_its_rings_admitted_share_keeps_the_default_and_a_plan_without_the_field_admits_all():
    ids = [f"dev-{i}" for i in range(400)]
    canary = [d for d in ids if bucket(d) < 10]
    half = parsed(rings=[{**PLAN["rings"][0], "admitted": 50}, PLAN["rings"][1]])
    assert half.rings[0].admitted == 50 and parsed().rings[0].admitted == 100  # absent: the whole ring
    admitted = {d for d in canary if version_for(half, d, {}) == "5"}
    assert admitted == {d for d in canary if admission_bucket(d) < 50}
    assert {version_for(half, d, {}) for d in set(canary) - admitted} == {"3"}  # the default: the previous version
    assert 0 < len(admitted) < len(canary)  # the second hash is not the ring's: a canary device may be either
    assert {version_for(parsed(), d, {}) for d in canary} == {"5"}
