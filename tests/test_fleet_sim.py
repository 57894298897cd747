"""Scenario 2 of the simulated fleet (benchmarks/fleet_sim.py) at 50 devices: a version that hardware revision
``a`` refuses is rolled out ring by ring; the canary ring halts, no device outside it ever holds the version,
and the canary devices of revisions b and c, which installed it, are back on the previous version. Real nginx,
mosquitto and agent code (edge.pull + TufClient + MqttReporter) in two worker processes."""

from __future__ import annotations

import shutil
import time

import pytest

from benchmarks.fleet_sim import SimFleet, run_rollout
from registry.rings import RingSpec, ring_of

pytestmark = [pytest.mark.slow,  # about 1.5 min on 2 cores: 50 devices polling every 2 s, a rollout and a halt
              pytest.mark.skipif(not (shutil.which("nginx") and shutil.which("mosquitto")),
                                 reason="needs Debian's nginx and mosquitto (make nginx mosquitto)")]
RINGS = [{"name": "canary", "percent": 20}, {"name": "all"}]
INTERVAL = 2.0


@pytest.fixture()
def fleet(tmp_path):
    fleet = SimFleet(tmp_path, devices=50, workers=2, interval_s=INTERVAL)
    try:
        fleet.start()
        fleet.wait_reported("1", 120)
        yield fleet
    finally:
        fleet.stop()


def test_a_version_one_hardware_revision_refuses_halts_in_the_canary_ring(fleet):
    spec = RingSpec.model_validate({"rings": RINGS})
    canary = {d for d in fleet.ids if ring_of(d, fleet.labels[d], spec) == "canary"}
    assert {fleet.labels[d]["hw"] for d in canary} == {"a", "b", "c"}, canary  # both kinds of device in the ring

    r = run_rollout(fleet, "3", "1", RINGS, min_devices=3, soak_s=30, poll_s=1, max_s=120)
    state = r["state"]
    assert state.status == "halted" and state.rings[0].status == "halted", (state.status, state.reason)
    assert state.reason.startswith("ring canary:") and r["elapsed_s"] < 60, (r["elapsed_s"], r["timeline"])
    assert state.rings[1].status == "waiting"
    assert set(state.rings[0].failed_devices) <= {d for d in canary if fleet.labels[d]["hw"] == "a"}, state.rings[0]

    got = fleet.received("3")
    assert got and set(got) <= canary, sorted(set(got) - canary)  # no device outside the canary ever held v3
    installed = {d for d in got if fleet.labels[d]["hw"] != "a"}
    assert installed, got  # revisions b and c installed v3: going back below is a real rollback

    deadline = time.monotonic() + 10 * INTERVAL + 30
    while True:
        versions = fleet.current_versions()
        behind = {d: v for d, v in versions.items() if v != "1"}
        if not behind:
            break
        assert time.monotonic() < deadline, f"not back on v1: {behind}"
        time.sleep(0.5)
    assert set(fleet.received("3")) <= canary
    for d in installed:  # each went back by the plan, through the real pull (journaled activation of v1)
        events = [e for e in (fleet.work / "stores" / d / "journal.jsonl").read_text().splitlines() if '"activate"' in e]
        assert '"version": "1"' in events[-1], (d, events[-2:])


def test_the_broker_and_the_repository_going_down_mid_rollout_pause_it_and_it_resumes(fleet):
    """Scenario 3: mosquitto stops while the canary rolls (no judgement, the rollout stands still, devices keep
    their policy), comes back; then nginx stops while ring all rolls (devices keep theirs and back off), comes back;
    the rollout ends done with every device on v2."""
    from flows.rollout import load_state

    outage, seen = {}, []

    def between(elapsed: float) -> None:
        state = load_state(fleet.work / "rollouts", fleet.policy)
        where = (state.status, state.ring, state.rings[state.ring].status)
        versions = set(fleet.current_versions().values())
        assert versions <= {"1", "2"}, versions  # no device without a policy, nothing else installed
        if "broker" not in outage:
            fleet.stop_broker()
            outage["broker"] = (time.monotonic(), where)
        elif "broker_back" not in outage:
            seen.append(where)
            if time.monotonic() - outage["broker"][0] > 8:
                fleet.restart_broker()
                outage["broker_back"] = time.monotonic()
        elif "repo" not in outage and state.rings[-1].status == "rolling":
            fleet.stop_repository()
            outage["repo"] = time.monotonic()
        elif "repo" in outage and "repo_back" not in outage and time.monotonic() - outage["repo"] > 8:
            fleet.restart_repository()
            outage["repo_back"] = time.monotonic()

    r = run_rollout(fleet, "2", "1", RINGS, min_devices=3, soak_s=3, poll_s=1, max_s=240, between=between)
    assert {"broker", "broker_back", "repo", "repo_back"} <= set(outage), (outage, r["timeline"])
    assert r["unjudged_polls"] >= 5, r["unjudged_polls"]  # each poll while the broker was down judged nothing
    assert seen and set(seen) == {outage["broker"][1]}, (outage["broker"][1], seen)  # the rollout stood still
    assert r["state"].status == "done", (r["state"].status, r["state"].reason, r["timeline"])
    assert fleet.stats()["checks"].get("tuf", 0) + fleet.stats()["checks"].get("backoff", 0) > 0
    fleet.wait_reported("2", 60)
    assert set(fleet.current_versions().values()) == {"2"}
