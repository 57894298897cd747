"""The rollout state machine (registry/rollout.py) on real device reports: rings advance after their soak, a
ring halts past its failure threshold and only its devices go back, a paused rollout judges nothing, an
aborted one sends every ring back, and the plan it publishes is what each device then runs. Under a rollout rate
a ring admits its devices minute by minute and a failure among the first admitted halts it before the rest."""

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
    state = control(start(CFG, 0.0), "pause", 1.0)
    assert judge(state, fleet(state, report), 50.0) == state
    state = judge(control(state, "resume", 50.0), fleet(state, report), 51.0)
    assert state.rings[0].status == "soaking"
    state = control(state, "abort", 52.0)
    assert state.status == "aborted" and {r["version"] for r in plan(state)["rings"]} == {"1"}
    assert control(state, "resume", 53.0).status == "aborted"
    with pytest.raises(ValueError, match="expected pause, resume or abort"):
        control(start(CFG, 0.0), "stop", 1.0)


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


ONE_RING = RingSpec.model_validate({"rings": [{"name": "all"}]})
RATED = CFG.model_copy(update={"rings": ONE_RING, "rate_base_per_min": 2, "rate_increment_factor": 2.0})


def on_new(state) -> set[str]:
    """The devices the published plan sends the new version (through the device's own functions)."""
    p = parse_plan(json.dumps(plan(state)).encode(), "tiny")
    return {d for d, labels in DEVICES.items() if version_for(p, d, labels) == "2"}


def test_a_rate_admits_devices_exponentially_minute_by_minute_and_the_ring_soaks_only_once_all_are_in():
    state = start(RATED, 0.0)
    assert on_new(state) == set() and plan(state)["rings"][0]["admitted"] == 0
    admitted = []
    for now in (1.0, 61.0, 121.0, 181.0, 241.0):  # due: 2, 2+4, 2+4+8, 2+4+8+16, then every one of the 60
        state = judge(state, fleet(state, report), now)
        assert state.rings[0].status == "rolling" and state.status == "running"
        admitted.append(on_new(state))
    assert [len(a) for a in admitted] == [2, 6, 14, 30, 60] and state.rings[0].admitted == 100
    assert all(a < b for a, b in zip(admitted, admitted[1:]))  # the first admitted stay admitted
    assert [t for t, _ in state.rings[0].admissions] == [1.0, 61.0, 121.0, 181.0, 241.0]
    state = judge(state, fleet(state, report), 242.0)
    assert (state.rings[0].status, state.rings[0].succeeded) == ("soaking", 60)
    state = judge(state, fleet(state, report), 253.0)
    assert state.status == "done" and on_new(state) == set(DEVICES)
    linear = CFG.model_copy(update={"rate_base_per_min": 5})
    assert [linear.due(t) for t in (0, 59, 60, 600)] == [5, 5, 10, 55]
    assert RATED.model_copy(update={"rate_increment_factor": 5.0}).due(10 ** 9) == float("inf")


def test_the_rate_clock_stops_while_paused():
    """Paused ten minutes in the ring's second minute: resuming admits what the second minute admits, not all 60."""
    state = judge(start(RATED, 0.0), fleet(start(RATED, 0.0), report), 1.0)
    state = judge(state, fleet(state, report), 61.0)
    assert len(on_new(state)) == 6
    state = control(control(state, "pause", 70.0), "pause", 300.0)  # a second pause changes nothing
    state = judge(control(state, "resume", 670.0), fleet(state, report), 671.0)
    assert state.rings[0].started == 600.0 and len(on_new(state)) == 6
    state = judge(state, fleet(state, report), 721.0)  # the ring's third minute, on its own clock
    assert len(on_new(state)) == 14


def test_failures_among_the_first_admitted_devices_halt_the_ring_and_the_rest_never_get_the_version():
    ever = set()

    def outcome(device, version):
        if version != "2":
            return report(device, version)
        ever.add(device)
        return report(device, "1", "rolled-back", last_error={"event": "health-rollback", "version": "2"})

    state = start(RATED.model_copy(update={"rate_base_per_min": 3}), 0.0)
    state = judge(state, fleet(state, outcome), 1.0)
    assert len(on_new(state)) == 3 and state.status == "running"
    state = judge(state, fleet(state, outcome), 61.0)  # the 3 admitted failed: min_devices 3 executed, 100 % bad
    assert state.status == "halted" and state.rings[0].failed == 3 and "3 of 3 devices" in state.reason
    assert on_new(state) == set()  # the ring is back on v1
    for now in (121.0, 600.0):
        assert judge(state, fleet(state, outcome), now) == state
    assert len(ever) == 3  # 57 devices of the ring never ran v2


def test_under_a_rate_a_device_times_out_counting_from_its_own_admission():
    state = start(RATED.model_copy(update={"min_devices": 20}), 0.0)
    stuck = [report(d, "1") for d in DEVICES]  # no device ever moves
    for now in (1.0, 61.0, 121.0, 150.0):
        state = judge(state, stuck, now)
    assert state.rings[0].timed_out == 2 and state.status == "running"  # admitted at 1 s; the 4 of 61 s are pending
    assert judge(state, stuck, 161.0).rings[0].timed_out == 6


def test_a_rate_is_validated_and_without_one_the_plan_is_todays():
    from pydantic import ValidationError

    assert all("admitted" not in r for r in plan(start(CFG, 0.0))["rings"])
    for bad in ({"rate_base_per_min": 0}, {"rate_base_per_min": 1001}, {"rate_base_per_min": 5,
                                                                          "rate_increment_factor": 5.5},
                {"rate_increment_factor": 2.0}):
        with pytest.raises(ValidationError):
            RolloutConfig.model_validate(CFG.model_dump() | bad)


@pytest.mark.parametrize("args,message", [
    (["--rate-base", "0"], "--rate-base 0: devices per minute, 1-1000"),
    (["--rate-base", "1001"], "--rate-base 1001: devices per minute, 1-1000"),
    (["--rate-base", "10", "--rate-factor", "6"], "--rate-factor 6: a factor in 1-5"),
    (["--rate-factor", "2"], "--rate-factor 2: needs --rate-base"),
])
def test_the_cli_refuses_a_bad_rate_in_one_line(args, message):
    from tests.conftest import run_cli

    done = run_cli("sim2edge", "rollout", "start", "tiny@1", "--repo", "/nonexistent", "--mqtt", "mqtt://127.0.0.1:1",
                   *args)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and out == f"error: {message}", out
