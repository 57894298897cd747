"""A staged rollout on a simulated fleet (issue 21): N devices running the real agent code in a few worker
processes (benchmarks/fleet_sim.py), polling a TUF repository through nginx and reporting over MQTT to mosquitto;
the rollout driven by the real state machine with the flow's steps.

Scenario 1: a good version (v2) rolls out through rings canary (2 %), early (to 20 %) and all.
Scenario 2: a version (v3) that hardware revision ``a`` refuses: the canary ring halts, no device outside it
receives v3, and the canary devices that installed it (revisions b and c) go back to v2.

Prints: time to converge, nginx requests/s, CPU seconds of the device processes per 1,000 devices (and per poll),
the halt time, devices that received v3 before the halt, devices outside the failing ring that received it.

Run: .venv/bin/python benchmarks/fleet.py --devices 1000 [--workers 4 --interval 30]
Then, side by side in the same run: the fleet polling the static repository (nginx) and the same fleet polling
the MLflow server (``<policy>@champion``): requests/s and CPU seconds of each server per 1,000 devices.
With ``--outages S``, scenario 3: a good version (v4) with the broker down S seconds while the canary rolls, then
the repository down S seconds while ring all rolls."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fleet_sim import SimFleet, run_rollout, tree_cpu_s  # noqa: E402

RINGS = [{"name": "canary", "percent": 2}, {"name": "early", "percent": 20}, {"name": "all"}]


def measure(fleet: SimFleet, run) -> tuple:
    """(result of ``run()``, seconds, nginx requests, device CPU seconds, device polls) over ``run()``."""
    s0, r0, t0 = fleet.stats(), fleet.nginx_requests(), time.time()
    result = run()
    time.sleep(2.5)  # the workers' next stats file
    s1, r1 = fleet.stats(), fleet.nginx_requests()
    return result, time.time() - t0, r1 - r0, s1["cpu_s"] - s0["cpu_s"], s1["polls"] - s0["polls"]


def servers_side_by_side(fleet: SimFleet, seconds: float) -> dict:
    """The same fleet polling the TUF repository (nginx), then the MLflow server (``<policy>@champion``, as
    `watch --registry URL --no-report` does: repair, then pull), each for ``seconds`` once every device reports
    v1 / runs: requests/s and CPU seconds of the server and of the devices, per 1,000 devices."""
    from flows import services
    from flows.workspace import Workspace
    from tests.bundles import publish
    from tests.conftest import free_port

    per = 1000 / fleet.n
    out = {}

    def window(server_pid: int, requests) -> dict:
        s0, r0, c0, m0, t0 = fleet.stats(), requests(), tree_cpu_s(server_pid), tree_cpu_s(fleet.broker.pid), time.time()
        time.sleep(seconds)
        s1, r1, c1, m1, t1 = fleet.stats(), requests(), tree_cpu_s(server_pid), tree_cpu_s(fleet.broker.pid), time.time()
        d = t1 - t0
        return {"seconds": round(d, 1), "requests_per_s": round((r1 - r0) / d, 1),
                "server_cpu_s_per_s_per_1000_devices": round((c1 - c0) / d * per, 3),
                "broker_cpu_s_per_s_per_1000_devices": round((m1 - m0) / d * per, 3),
                "device_cpu_s_per_s_per_1000_devices": round((s1["cpu_s"] - s0["cpu_s"]) / d * per, 3),
                "polls_per_s": round((s1["polls"] - s0["polls"]) / d, 1), "device_lag_max_s": round(s1["lag_max_s"], 1)}

    out["tuf_nginx"] = window(fleet.nginx.pid, fleet.nginx_requests)
    print(f"static repository (nginx): {json.dumps(out['tuf_nginx'])}", flush=True)
    fleet.stop_workers()
    port, ws = free_port(), Workspace(home=fleet.work)
    url, log = f"http://127.0.0.1:{port}", fleet.work / "mlflow.log"
    server = services.start(ws, "mlflow", services.mlflow_command(ws, "127.0.0.1", port), url, "/health", log)
    try:
        services.wait_healthy([server], timeout_s=180)
        publish(url, fleet.work / f"{fleet.policy}-1.tar", fleet.policy, "champion")
        fleet.seed_stores(registry=url)
        c0 = tree_cpu_s(server.process.pid)
        time.sleep(10)
        out["mlflow_server_without_devices_cpu_s_per_s"] = round((tree_cpu_s(server.process.pid) - c0) / 10, 3)
        fleet.start_workers(registry=url)
        fleet.wait_reported("1", 10 * fleet.interval_s + 120)

        def requests() -> int:
            return sum(1 for line in log.read_bytes().splitlines() if b'HTTP/1.1"' in line)

        out["mlflow"] = window(server.process.pid, requests)
        print(f"MLflow server: {json.dumps(out['mlflow'])}", flush=True)
    finally:
        fleet.stop_workers()
        services.stop([server])
    return out


def outages(fleet: SimFleet, min_devices: int, soak: float, args) -> dict:
    """Scenario 3: v4 (good, previous v2) with mosquitto stopped for ``args.outages`` s while the canary rolls and
    nginx stopped as long while ring all rolls: whether the rollout stood still while the broker was down, whether
    any device was left without a policy, and how long after each return the rollout moved on / ended."""
    from flows.rollout import load_state

    marks: dict = {"without_policy": 0, "during_broker_outage": set()}

    def between(elapsed: float) -> None:
        state = load_state(fleet.work / "rollouts", fleet.policy)
        where = (state.status, state.ring, state.rings[state.ring].status)
        marks["without_policy"] = max(marks["without_policy"],
                                      sum(v is None for v in fleet.current_versions().values()))
        now = time.monotonic()
        if "broker_down" not in marks and state.rings[0].status == "rolling":
            fleet.stop_broker()
            marks["broker_down"], marks["at"] = now, where
        elif "broker_down" in marks and "broker_back" not in marks:
            marks["during_broker_outage"].add(where)
            if now - marks["broker_down"] >= args.outages:
                fleet.restart_broker()
                marks["broker_back"] = now
        elif "broker_back" in marks and "moved_after_broker_s" not in marks and where != marks["at"]:
            marks["moved_after_broker_s"] = now - marks["broker_back"]
        if "repo_down" not in marks and state.rings[-1].status == "rolling":
            fleet.stop_repository()
            marks["repo_down"] = now
        elif "repo_down" in marks and "repo_back" not in marks and now - marks["repo_down"] >= args.outages:
            fleet.restart_repository()
            marks["repo_back"] = now

    r = run_rollout(fleet, "4", "2", RINGS, min_devices=min_devices, soak_s=soak, poll_s=args.poll,
                    max_s=30 * args.interval + 600, between=between)
    end = time.monotonic()
    checks = fleet.stats()["checks"]
    return {"status": r["state"].status, "reason": r["state"].reason, "rollout_s": round(r["elapsed_s"], 1),
            "unjudged_polls": r["unjudged_polls"],
            "stood_still": marks["during_broker_outage"] <= {marks.get("at")},
            "most_devices_without_policy": marks["without_policy"],
            "moved_on_s_after_broker_back": round(marks.get("moved_after_broker_s", -1), 1),
            "done_s_after_repository_back": round(end - marks["repo_back"], 1) if "repo_back" in marks else None,
            "refusals_by_check": checks, "timeline": r["timeline"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4, help="device processes (default %(default)s)")
    ap.add_argument("--interval", type=float, default=30.0, help="each device's polling interval, s (default %(default)s)")
    ap.add_argument("--poll", type=float, default=5.0, help="the rollout's judging interval, s (default %(default)s)")
    ap.add_argument("--soak", type=float, default=None, help="soak per ring, s (default: one interval)")
    ap.add_argument("--min-devices", type=int, default=None, help="default: a quarter of the canary ring")
    ap.add_argument("--work", type=Path, help="working directory (default: a new one under /dev/shm)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--outages", type=float, default=0, metavar="S",
                    help="scenario 3: roll v4 out with the broker down S s while the canary rolls, then the repository "
                         "down S s while ring all rolls (default: not run)")
    ap.add_argument("--no-mlflow", action="store_true", help="skip the static repository vs MLflow server comparison")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fleet-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    soak = args.interval if args.soak is None else args.soak
    min_devices = args.min_devices or max(2, int(args.devices * RINGS[0]["percent"] / 100 / 4))
    fleet = SimFleet(work, args.devices, args.workers, args.interval)
    figures: dict = {"devices": args.devices, "workers": args.workers, "interval_s": args.interval,
                     "rollout_poll_s": args.poll, "soak_s": soak, "min_devices": min_devices, "work": str(work)}
    try:
        t = time.time()
        fleet.start()
        figures["setup_s"] = round(time.time() - t, 1)
        print(f"fleet of {args.devices} devices in {args.workers} processes, interval {args.interval:g} s, "
              f"set up in {figures['setup_s']} s ({work})", flush=True)
        first = fleet.wait_reported("1", 10 * args.interval + 120)
        print(f"every device reported v1 after {first:.1f} s", flush=True)
        _, idle_s, idle_req, idle_cpu, idle_polls = measure(fleet, lambda: time.sleep(args.interval))
        figures["idle"] = {"seconds": round(idle_s, 1), "nginx_requests_per_s": round(idle_req / idle_s, 1),
                           "device_cpu_s_per_1000_devices_per_s": round(idle_cpu / idle_s * 1000 / args.devices, 3),
                           "device_cpu_ms_per_poll": round(1000 * idle_cpu / max(1, idle_polls), 1)}
        print(f"idle (every device on v1, polling): {json.dumps(figures['idle'])}", flush=True)

        def good():
            r = run_rollout(fleet, "2", "1", RINGS, min_devices=min_devices, soak_s=soak, poll_s=args.poll,
                            max_s=30 * args.interval + 600)
            r["all_on_v2_s"] = time.time() - r["t0"] if r["state"].status != "done" else \
                r["elapsed_s"] + fleet.wait_reported("2", 3 * args.interval + 60)
            return r

        r, s, req, cpu, polls = measure(fleet, good)
        st = r["state"]
        figures["good"] = {"status": st.status, "rollout_done_s": round(r["elapsed_s"], 1),
                           "every_device_reports_v2_s": round(r["all_on_v2_s"], 1),
                           "ring_devices": {g.name: g.devices for g in st.rings},
                           "ring_started_s": {k: round(v, 1) for k, v in r["ring_started_s"].items()},
                           "nginx_requests": req, "nginx_requests_per_s": round(req / s, 1),
                           "device_cpu_s": round(cpu, 1), "device_cpu_s_per_1000_devices": round(cpu * 1000 / args.devices, 1),
                           "device_cpu_ms_per_poll": round(1000 * cpu / max(1, polls), 1), "polls": polls,
                           "unjudged_polls": r["unjudged_polls"], "read_fleet_median_s": r["read_fleet_s"]}
        print(f"scenario 1 (v2 good): {json.dumps(figures['good'])}", flush=True)
        if st.status != "done":
            print(f"fleet: scenario 1 ended {st.status}: {st.reason}", file=sys.stderr)
            return 1

        before_v3 = fleet.nginx_requests("/3.tar")
        r, s, req, cpu, polls = measure(fleet, lambda: run_rollout(
            fleet, "3", "2", RINGS, min_devices=min_devices, soak_s=soak, poll_s=args.poll,
            max_s=10 * args.interval + 300))
        st = r["state"]
        halted_at = r["t0"] + r["elapsed_s"]
        from registry.rings import RingSpec, ring_of

        spec = RingSpec.model_validate({"rings": RINGS})
        canary = {d for d in fleet.ids if ring_of(d, fleet.labels[d], spec) == "canary"}
        got = fleet.received("3")
        back = time.time()
        while True:  # the canary devices go back to v2 (the plan directs them there after the halt)
            versions = fleet.current_versions()
            on_v3 = [d for d in canary if versions[d] != "2"]
            if not on_v3 or time.time() - back > 3 * args.interval + 60:
                break
            time.sleep(1)
        figures["bad"] = {
            "status": st.status, "reason": st.reason, "halt_s": round(r["elapsed_s"], 1),
            "canary_devices": len(canary), "canary_hw_a": sum(fleet.labels[d]["hw"] == "a" for d in canary),
            "received_before_halt": sum(t <= halted_at for t in got.values()), "received_total": len(got),
            "received_outside_canary": sorted(set(got) - canary),
            "nginx_gets_of_v3": fleet.nginx_requests("/3.tar") - before_v3,
            "canary_back_on_v2_s_after_halt": round(time.time() - halted_at, 1), "canary_not_on_v2": on_v3[:10],
            "read_fleet_median_s": r["read_fleet_s"],
            "nginx_requests_per_s": round(req / s, 1), "device_cpu_s_per_1000_devices": round(cpu * 1000 / args.devices, 1),
            "timeline": r["timeline"]}
        print(f"scenario 2 (v3 refused by hw a): {json.dumps(figures['bad'])}", flush=True)
        ok = st.status == "halted" and not figures["bad"]["received_outside_canary"] and not on_v3
        figures["stats"] = fleet.stats()
        if args.outages:
            figures["outages"] = outages(fleet, min_devices, soak, args)
            print(f"scenario 3 (broker, then repository down mid-rollout): {json.dumps(figures['outages'])}",
                  flush=True)
            ok = ok and figures["outages"]["status"] == "done" and figures["outages"]["stood_still"]
        if not args.no_mlflow:
            figures["servers"] = servers_side_by_side(fleet, max(30.0, args.interval))
    finally:
        fleet.stop()
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1, default=str))
    g, b = figures["good"], figures["bad"]
    print(f"\n{args.devices} devices, interval {args.interval:g} s: v2 rollout done in {g['rollout_done_s']} s "
          f"(every device on v2 at {g['every_device_reports_v2_s']} s); nginx {g['nginx_requests_per_s']} req/s; "
          f"device CPU {g['device_cpu_s_per_1000_devices']} s per 1,000 devices for the rollout "
          f"({g['device_cpu_ms_per_poll']} ms per poll; idle {figures['idle']['device_cpu_s_per_1000_devices_per_s']} "
          f"CPU s/s per 1,000)\nv3: {b['status']} after {b['halt_s']} s; {b['received_before_halt']} devices received "
          f"it before the halt ({b['received_total']} in all, canary {b['canary_devices']} devices of which "
          f"{b['canary_hw_a']} hw a); outside the canary: {len(b['received_outside_canary'])}; canary back on v2 "
          f"{b['canary_back_on_v2_s_after_halt']} s after the halt")
    for name, v in ((k, v) for k, v in figures.get("servers", {}).items() if isinstance(v, dict)):
        print(f"{name}: {v['requests_per_s']} req/s, server {v['server_cpu_s_per_s_per_1000_devices']} CPU s/s per "
              f"1,000 devices, devices {v['device_cpu_s_per_s_per_1000_devices']}, broker "
              f"{v['broker_cpu_s_per_s_per_1000_devices']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
