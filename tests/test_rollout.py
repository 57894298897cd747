"""The rollout state machine (registry/rollout.py) on real device reports: rings advance after their soak, a
ring halts past its failure threshold and only its devices go back, a paused rollout judges nothing, an
aborted one sends every ring back, and the plan it publishes is what each device then runs."""

from __future__ import annotations

import json
import time

import pytest

from edge.rollout_plan import parse_plan, version_for
from registry.fleet_state import DeviceReport
from registry.rings import RingSpec, ring_of
from registry.rollout import RolloutConfig, control, judge, plan, start

SPEC = RingSpec.model_validate({"rings": [{"name": "canary", "match": {"hw": "a"}, "percent": 20},
                                          {"name": "all"}]})
CFG = RolloutConfig(policy="tiny", version="2", previous="1", rings=SPEC, abort_failed_percent=20, min_devices=3,
                    soak_s=10, ring_timeout_s=100)
DEVICES = {f"d{i:03d}": {"hw": "a" if i % 2 else "b"} for i in range(60)}


def report(device: str, version: str, health: str = "ok", t: float = 1.0, **extra) -> DeviceReport:
    return DeviceReport(fleet="f", device=device, policy="tiny", version=version, health=health, pull_failures=0,
                        missed_reports=0, labels=DEVICES[device], time=t, **extra)


def fleet(state, outcome) -> list[DeviceReport]:
    """Every device as it would report after following the published plan; ``outcome(device, version)`` may
    turn a report into a failure."""
    p = parse_plan(json.dumps(plan(state)).encode(), "tiny")
    return [outcome(d, version_for(p, d, labels)) for d, labels in DEVICES.items()]


def in_ring(name: str) -> set[str]:
    return {d for d, labels in DEVICES.items() if ring_of(d, labels, SPEC) == name}


def test_a_good_version_rolls_through_every_ring_after_its_soak():
    state = start(CFG, 0.0)
    assert {version_for(parse_plan(json.dumps(plan(state)).encode(), "tiny"), d, DEVICES[d])
            for d in in_ring("all")} == {"1"}
    state = judge(state, fleet(state, report), 1.0)
    assert state.rings[0].status == "soaking" and state.rings[0].succeeded == len(in_ring("canary")) > 3
    assert judge(state, fleet(state, report), 5.0).ring == 0  # still soaking
    state = judge(state, fleet(state, report), 11.0)
    assert (state.ring, state.rings[0].status, state.rings[1].status) == (1, "passed", "rolling")
    state = judge(judge(state, fleet(state, report), 12.0), fleet(state, report), 30.0)
    assert state.status == "done" and plan(state)["default"] == "2"
    assert {r["version"] for r in plan(state)["rings"]} == {"2"}


@pytest.mark.parametrize("failure", ["refused", "rolled-back", "corrupt", "timed-out"])
def test_a_failing_hardware_revision_halts_its_ring_and_only_that_ring_goes_back(failure):
    def outcome(device, version):
        if version != "2" or DEVICES[device]["hw"] != "a":
            return report(device, version)
        if failure == "refused":
            return report(device, "1", last_refusal={"policy": "tiny", "version": "2", "check": "health", "time": 5})
        if failure == "rolled-back":
            return report(device, "1", "rolled-back", last_error={"event": "health-rollback", "version": "2"})
        return report(device, "2", "corrupt") if failure == "corrupt" else report(device, "1")

    state = start(CFG, 0.0)
    state = judge(state, fleet(state, outcome), 150.0 if failure == "timed-out" else 1.0)
    assert state.status == "halted" and state.rings[0].status == "halted", state
    assert "ring canary" in state.reason and "threshold 20%" in state.reason
    p = parse_plan(json.dumps(plan(state)).encode(), "tiny")
    assert {version_for(p, d, DEVICES[d]) for d in DEVICES} == {"1"}  # no device outside the ring got v2 either
    assert judge(state, fleet(state, report), 200.0) == state  # a halted rollout stays halted


def test_the_threshold_waits_for_min_devices_and_tolerates_failures_below_it():
    canary = sorted(in_ring("canary"))
    bad = canary[:1]

    def outcome(device, version):
        return report(device, "1", "rolled-back", last_error={"version": "2"}) if device in bad else report(device, version)

    cfg = CFG.model_copy(update={"abort_failed_percent": 100 / len(canary) + 1})
    state = judge(start(cfg, 0.0), fleet(start(cfg, 0.0), outcome), 1.0)
    assert state.status == "running" and state.rings[0].failed == 1 and state.rings[0].status == "soaking"
    state = judge(state, fleet(state, outcome), 12.0)  # below the threshold the ring passes after its soak
    assert (state.ring, state.rings[0].status, state.rings[1].status) == (1, "passed", "rolling")
    strict = CFG.model_copy(update={"abort_failed_percent": 100 / len(canary) - 1})  # the same failure, above it
    assert judge(start(strict, 0.0), fleet(start(strict, 0.0), outcome), 1.0).status == "halted"
    pending = [outcome(d, "2") if d in bad else report(d, "1") for d in canary]  # not updated yet, not timed out
    assert judge(start(CFG, 0.0), pending, 1.0).status == "running"  # 1 executed < min_devices 3


def test_pause_resume_and_abort():
    state = control(start(CFG, 0.0), "pause")
    assert judge(state, fleet(state, report), 50.0) == state
    state = judge(control(state, "resume"), fleet(state, report), 51.0)
    assert state.rings[0].status == "soaking"
    state = control(state, "abort")
    assert state.status == "aborted" and {r["version"] for r in plan(state)["rings"]} == {"1"}
    assert control(state, "resume").status == "aborted"
    with pytest.raises(ValueError, match="expected pause, resume or abort"):
        control(start(CFG, 0.0), "stop")


def test_a_state_saved_and_loaded_judges_the_same():
    from registry.rollout import RolloutState

    state = judge(start(CFG, time.time()), fleet(start(CFG, 0.0), report), time.time())
    again = RolloutState.model_validate_json(state.model_dump_json())
    assert again == state and plan(again) == plan(state)


def test_a_ring_no_device_reports_in_holds_past_its_soak_and_says_why():
    """No device of ring canary known: nothing executed, so nothing judged; it must not pass an empty soak."""
    others = [report(d, "1") for d in in_ring("all")]
    state = start(CFG, 0.0)
    for now in (1.0, 50.0, 10 * CFG.soak_s + CFG.ring_timeout_s):
        state = judge(state, others, now)
        assert (state.status, state.ring, state.rings[0].status, state.rings[0].devices) == ("running", 0, "rolling", 0)
    assert state.reason == state.rings[0].reason and state.reason.startswith("ring canary: no device of this ring")
    assert "does not pass its soak" in state.reason and plan(state)["default"] == "1"
    state = judge(state, fleet(state, report), 1001.0)  # its devices report: judged again, soak from now
    assert (state.rings[0].status, state.rings[0].soak_started, state.reason) == ("soaking", 1001.0, "")
    state = judge(state, fleet(state, report), 1012.0)
    assert (state.ring, state.rings[0].status) == (1, "passed")
