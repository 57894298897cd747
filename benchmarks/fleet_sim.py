"""A simulated fleet: many devices running the real agent code, a few worker processes with many devices each.

Each device has its own store directory, device id and labels (``hw`` revision, ``target`` profile). A worker
polls its devices one at a time on a schedule (interval × uniform(1-jitter, 1+jitter), first polls spread over
one interval) and each poll is what ``sim2edge-agent watch --tuf`` does on each of its polls (edge/pull.py
``watch`` with a TUF source): ``edge.pull.pull`` through ``edge.tuf_client.TufClient`` (the device's ring from
the signed ``rollout.json``), then ``edge.mqtt_report.MqttReporter.report`` of ``edge.report.device_state``.

A version that fails on one hardware revision is simulated as tests/test_rollout_fleet.py does it: the bad
version's signed manifest records a failed evaluation gate, which the devices of that revision refuse (check
``gate``) once downloaded, while the devices of the other revisions are run with ``allow_failed_gate`` and install
it. So only the failing revision refuses it, and a device of another revision that is offered it really installs it.

The rollout is driven by the real state machine (registry/rollout.py) with the flow's own steps
(flows/rollout.py: ``read_fleet`` → ``judge`` → ``publish_plan`` → ``save_state``), without Prefect's API.

Workers write ``<dir>/stats-<n>.json`` every few seconds (CPU seconds, polls, schedule lag, refusals by check);
what each device received is read afterwards from its store (journal and ``failed.json``).

Worker entry point: ``python benchmarks/fleet_sim.py worker SPEC.json`` (spawned by :class:`SimFleet`)."""

from __future__ import annotations

import heapq
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HW_REVISIONS = ("a", "b", "c")
TARGET_PROFILES = ("orin-jp6.1", "orin-nano-jp6.1")


def device_labels(i: int) -> Dict[str, str]:
    """Device ``i``'s labels: hardware revisions and target profiles spread evenly over the fleet."""
    return {"hw": HW_REVISIONS[i % len(HW_REVISIONS)], "target": TARGET_PROFILES[(i // 3) % len(TARGET_PROFILES)]}


def device_id(i: int) -> str:
    return f"sim{i:05d}"


# --------------------------------------------------------------------------------------------------- the worker


@dataclass
class SimDevice:
    device: str
    labels: Dict[str, str]
    root: Path
    poll: Callable[[], None] = field(repr=False, default=None)


def make_device(spec: dict, device: str, labels: Dict[str, str]) -> SimDevice:
    """The per-poll work of ``watch --tuf --report mqtt://`` for one device (edge/cli.py ``_watch``)."""
    from edge import mqtt_report
    from edge.errors import CheckFailed
    from edge.pull import PullOptions, pull
    from edge.registry_client import TransferOptions
    from edge.report import device_state
    from edge.signing import load_trusted
    from edge.store import DeviceStore
    from edge.tuf_client import TufClient

    root = Path(spec["stores"]) / device
    trusted = load_trusted([Path(spec["trust"])])
    transfer = TransferOptions(attempts=1, timeout_s=spec["timeout_s"], deadline_s=2 * spec["timeout_s"])
    options = PullOptions(transfer, backoff_base_s=spec["backoff_s"],
                          allow_failed_gate=labels.get("hw") != spec["failing_hw"])
    url, tuf_root = spec["repo_url"], Path(spec["tuf_root"])

    def source(store):
        return TufClient(url, tuf_root, store, transfer, device, labels)

    store = DeviceStore(root)
    reporter = mqtt_report.MqttReporter(root, mqtt_report.parse_broker(spec["broker"]), spec["fleet"], device,
                                        f"pw-{device}", labels, lambda: device_state(store, trusted, device))
    checks: Dict[str, int] = spec.setdefault("_checks", {})

    registry = spec.get("registry")  # MLflow mode: `watch --registry URL <policy>@champion --no-report`

    def poll() -> None:
        try:
            if registry:
                from edge.pull import _repair

                _repair(root, registry, trusted, options)  # watch does this before each MLflow poll
                pull(f"{spec['policy']}@champion", registry, root, trusted, True, options)
            else:
                pull(spec["policy"], url, root, trusted, True, options, source)
        except CheckFailed as e:  # watch: said on stderr, the loop goes on
            checks[e.check] = checks.get(e.check, 0) + 1
        reporter.report()

    return SimDevice(device, labels, root, poll)


def worker(spec_path: Path) -> None:
    """Poll this worker's devices until SIGTERM; write the stats file every ``stats_s``."""
    spec = json.loads(spec_path.read_text())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    rng = random.Random(spec["seed"])
    devices = [make_device(spec, d, labels) for d, labels in spec["devices"]]
    interval, jitter = spec["interval_s"], spec["jitter"]
    now = time.time()
    due = [(now + rng.uniform(0, interval), i) for i in range(len(devices))]
    heapq.heapify(due)
    polls, lags, last_stats = 0, [], 0.0
    stats_path = Path(spec["stats"])

    def write_stats() -> None:
        t = os.times()
        ordered = sorted(lags[-2000:]) or [0.0]
        data = {"cpu_s": t.user + t.system, "polls": polls, "time": time.time(), "checks": spec["_checks"],
                "lag_p50_s": ordered[len(ordered) // 2], "lag_max_s": ordered[-1], "devices": len(devices)}
        tmp = stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, stats_path)

    while not stopping:
        when, i = due[0]
        wait = when - time.time()
        if wait > 0:
            time.sleep(min(wait, 0.2))
        else:
            heapq.heappop(due)
            lags.append(-wait)
            devices[i].poll()
            polls += 1
            heapq.heappush(due, (time.time() + interval * rng.uniform(1 - jitter, 1 + jitter), i))
        if time.time() - last_stats >= spec["stats_s"]:
            write_stats()
            last_stats = time.time()
    write_stats()


# --------------------------------------------------------------------------------------------------- the fleet


class SimFleet:
    """Servers (nginx with the TUF repository, mosquitto), the bundles v1 (active everywhere at the start), v2 and
    v4 (good) and v3 (refused by hardware revision ``failing_hw``), the device stores, and the worker processes."""

    def __init__(self, work: Path, devices: int, workers: int, interval_s: float, jitter: float = 0.2,
                 failing_hw: str = "a", policy: str = "fleetsim", fleet: str = "sim") -> None:
        self.work, self.n, self.workers_n = Path(work), devices, workers
        self.interval_s, self.jitter, self.failing_hw, self.policy, self.fleet = (
            interval_s, jitter, failing_hw, policy, fleet)
        self.procs: List[subprocess.Popen] = []
        self.nginx = self.broker = None
        self.ids = [device_id(i) for i in range(devices)]
        self.labels = {device_id(i): device_labels(i) for i in range(devices)}

    # setup
    def start_servers(self) -> None:
        from tests.conftest import free_port
        from tests.servers import start_mosquitto, start_nginx

        self.web, self.mq = self.work / "nginx", self.work / "mosquitto"
        self.http_port, self.mqtt_port = free_port(), free_port()
        self.nginx = start_nginx(self.web, self.http_port)
        users = {**{d: f"pw-{d}" for d in [*self.ids, "template"]}, "sim2edge-reader": "pw-reader"}
        self.broker = start_mosquitto(self.mq, self.mqtt_port, users)
        self.broker_url = f"mqtt://127.0.0.1:{self.mqtt_port}"
        self.repo = self.web / "www" / "repo"
        self.repo_url = f"http://127.0.0.1:{self.http_port}/repo"
        self.keys = self.work / "tuf-keys"
        (self.work / "reader.pw").write_text("pw-reader\n")

    def stop_broker(self) -> None:
        self.broker.terminate()
        self.broker.wait(timeout=10)

    def restart_broker(self) -> None:
        from tests.servers import wait_listening

        self.broker = subprocess.Popen(["mosquitto", "-c", str(self.mq / "mosquitto.conf")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_listening(self.broker, self.mqtt_port)

    def stop_repository(self) -> None:
        from tests.servers import stop_nginx

        stop_nginx(self.web, self.nginx)

    def restart_repository(self) -> None:
        from tests.servers import start_nginx

        self.nginx = start_nginx(self.web, self.http_port)

    def publish_bundles(self) -> None:
        """v1, v2 and v4 pass their gate, v3 records a failed one; v1 is latest.tar, the others reach devices only
        through a rollout (published without moving latest.tar, as `sim2edge rollout start` does)."""
        from registry.tuf_repo import PublishConfig, publish
        from tests.bundles import GATE_FAILED, GATE_PASSED, make_bundle, make_keys

        self.priv, self.pub = make_keys(self.work)
        for v, gate in (("1", GATE_PASSED), ("2", GATE_PASSED), ("3", GATE_FAILED), ("4", GATE_PASSED)):
            tar = self.work / f"{self.policy}-{v}.tar"
            # a 10 Hz policy: with a 50 Hz one the smoke test's latency check (p99 under the control period) refused
            # a good version on a device now and then when 1,000 of them share 2 loaded cores (20.44 ms > 20 ms)
            make_bundle(tar, self.priv, version=v, name=self.policy, evaluation=gate, period_s=0.1)
            publish(PublishConfig(repo=self.repo, keys=self.keys, bundle=tar, policy=self.policy, version=v,
                                  move_latest=v == "1"))

    def spec(self, n: int, devices: list) -> dict:
        return {"devices": devices, "stores": str(self.work / "stores"), "trust": str(self.pub),
                "repo_url": self.repo_url, "tuf_root": str(self.repo / "metadata" / "root.json"),
                "broker": self.broker_url, "fleet": self.fleet, "policy": self.policy, "interval_s": self.interval_s,
                "jitter": self.jitter, "failing_hw": self.failing_hw, "backoff_s": self.interval_s,
                "timeout_s": 10.0, "seed": n, "stats": str(self.work / f"stats-{n}.json"), "stats_s": 2.0}

    def seed_stores(self, registry: str = "") -> None:
        """One real pull of v1 (latest.tar; with ``registry``: ``<policy>@champion`` from MLflow) into a template
        store, copied to every device's store: every device starts on v1, as after its first `watch` poll."""
        template = self.work / "template"
        shutil.rmtree(template, ignore_errors=True)
        spec = self.spec(0, [])
        spec["stores"] = str(template.parent)
        spec["fleet"] = "seed"  # its report is retained; in the fleet's topic it would be a device that never moves
        if registry:
            spec["registry"] = registry
        make_device(spec, template.name, {"hw": "b"}).poll()
        from edge.store import DeviceStore

        current = DeviceStore(template).link("current")
        if current is None or current.name != "1":
            raise RuntimeError(f"the template device did not install v1: {DeviceStore(template).history()[-1:]}")
        (template / "mqtt-report.json").unlink(missing_ok=True)
        stores = self.work / "stores"
        shutil.rmtree(stores, ignore_errors=True)
        stores.mkdir()
        for d in self.ids:
            shutil.copytree(template, stores / d, symlinks=True)

    def start_workers(self, registry: str = "") -> None:
        """The worker processes, polling the TUF repository (or, with ``registry``, the MLflow server)."""
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        for n in range(self.workers_n):
            mine = [[d, self.labels[d]] for d in self.ids[n::self.workers_n]]
            path = self.work / f"worker-{n}.json"
            spec = self.spec(n, mine)
            if registry:
                spec["registry"] = registry
            (self.work / f"stats-{n}.json").unlink(missing_ok=True)
            path.write_text(json.dumps(spec))
            log = open(self.work / f"worker-{n}.log", "wb")
            self.procs.append(subprocess.Popen([sys.executable, __file__, "worker", str(path)], env=env,
                                               stdout=log, stderr=subprocess.STDOUT))

    def start(self) -> "SimFleet":
        self.start_servers()
        self.publish_bundles()
        self.seed_stores()
        self.start_workers()
        return self

    def stop_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []

    def stop(self) -> None:
        from tests.servers import stop_nginx

        self.stop_workers()
        if self.broker is not None and self.broker.poll() is None:
            self.stop_broker()
        if self.nginx is not None:
            stop_nginx(self.web, self.nginx)

    # observation
    def check_workers(self) -> None:
        dead = [n for n, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            log = (self.work / f"worker-{dead[0]}.log").read_text()[-2000:]
            raise RuntimeError(f"fleet worker {dead[0]} exited with {self.procs[dead[0]].returncode}: {log}")

    def stats(self) -> dict:
        """The workers' summed CPU seconds and polls, and their worst schedule lag, as last written."""
        total = {"cpu_s": 0.0, "polls": 0, "lag_max_s": 0.0, "checks": {}}
        for n in range(self.workers_n):
            path = self.work / f"stats-{n}.json"
            if not path.exists():
                continue
            s = json.loads(path.read_text())
            total["cpu_s"] += s["cpu_s"]
            total["polls"] += s["polls"]
            total["lag_max_s"] = max(total["lag_max_s"], s["lag_max_s"])
            for k, v in s["checks"].items():
                total["checks"][k] = total["checks"].get(k, 0) + v
        return total

    def nginx_requests(self, path_part: str = "") -> int:
        log = self.web / "access.log"
        if not log.exists():
            return 0
        with open(log, "rb") as f:
            return sum(1 for line in f if path_part.encode() in line) if path_part else sum(1 for _ in f)

    def reports(self) -> list:
        from registry.fleet_state import read_fleet

        return read_fleet(self.broker_url, self.fleet, "sim2edge-reader", "pw-reader").devices

    def wait_reported(self, version: str, timeout_s: float) -> float:
        """Seconds until every device reports ``version`` healthy over MQTT; RuntimeError naming the laggards."""
        start = time.monotonic()
        while True:
            self.check_workers()
            reports = {r.device: r for r in self.reports()}
            behind = [d for d in self.ids if d not in reports or reports[d].version != version
                      or reports[d].health != "ok"]
            if not behind:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"{len(behind)} devices do not report v{version} after {timeout_s:.0f} s, "
                                   f"e.g. {behind[:5]}")
            time.sleep(min(2.0, self.interval_s / 2))

    def current_versions(self) -> Dict[str, Optional[str]]:
        out = {}
        for d in self.ids:
            link = self.work / "stores" / d / "current"
            out[d] = os.readlink(link).rsplit("/", 1)[-1] if link.is_symlink() else None
        return out

    def received(self, version: str) -> Dict[str, float]:
        """Devices whose store shows they downloaded ``version`` (activated it, or refused it after download: an
        entry in failed.json), each with the first time it did."""
        got = {}
        for d in self.ids:
            root = self.work / "stores" / d
            times = []
            failed = root / "failed.json"
            if failed.exists():
                for e in json.loads(failed.read_text()).values():
                    if (e.get("policy"), str(e.get("version"))) == (self.policy, version):
                        times.append(float(e.get("first_time", e.get("time", 0))))
            journal = root / "journal.jsonl"
            for line in journal.read_text().splitlines() if journal.exists() else ():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == "activate" and str(e.get("version")) == version:
                    times.append(float(e["time"]))
            if times:
                got[d] = min(times)
        return got


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its living descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    children: Dict[int, List[int]] = {}
    stats: Dict[int, List[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / tick
        todo.extend(children.get(p, []))
    return total


# --------------------------------------------------------------------------------------------------- the rollout


def run_rollout(fleet: SimFleet, version: str, previous: str, rings: list, *, min_devices: int, soak_s: float,
                poll_s: float, abort_failed_percent: float = 5.0, ring_timeout_s: float = 600.0,
                max_s: float = 900.0, between: Optional[Callable[[float], None]] = None) -> dict:
    """Roll ``version`` out with the flow's steps (flows/rollout.py) until it ends or ``max_s``; returns the final
    state and a timeline: (seconds since start, status, ring, ring status) whenever it changed, plus when each
    ring started and when the rollout halted or finished. ``between(elapsed)`` runs after each poll (outages)."""
    from flows.rollout import RolloutParams, publish_plan, save_state
    from registry.fleet_state import read_fleet
    from registry.rings import RingSpec
    from registry.rollout import RolloutConfig, judge, start

    cfg = RolloutConfig(policy=fleet.policy, version=version, previous=previous,
                        rings=RingSpec.model_validate({"rings": rings}), abort_failed_percent=abort_failed_percent,
                        min_devices=min_devices, soak_s=soak_s, ring_timeout_s=ring_timeout_s)
    params = RolloutParams(config=cfg, repo=fleet.repo, key_dir=fleet.keys, broker=fleet.broker_url,
                           fleet=fleet.fleet, mqtt_password_file=fleet.work / "reader.pw",
                           state_dir=fleet.work / "rollouts", poll_s=poll_s)
    t0 = time.time()
    state = start(cfg, t0)
    timeline, last, unjudged, reads = [], None, 0, []
    ring_started = {state.rings[0].name: 0.0}
    while True:
        fleet.check_workers()
        read = time.monotonic()
        try:
            reports = read_fleet(params.broker, params.fleet, params.mqtt_user, "pw-reader").devices
            reads.append(time.monotonic() - read)
        except OSError:
            reports, unjudged = None, unjudged + 1  # the flow: nothing judged this poll
        if reports is not None:
            state = judge(state, reports, time.time())
        state = publish_plan(params, state)
        save_state(params.state_dir, state)
        now = time.time() - t0
        ring = state.rings[state.ring]
        key = (state.status, ring.name, ring.status)
        if key != last:
            timeline.append((round(now, 1), *key))
            last = key
        ring_started.setdefault(ring.name, now)
        if state.ended or now > max_s:
            break
        if between is not None:
            between(now)
        time.sleep(poll_s)
    return {"state": state, "timeline": timeline, "elapsed_s": time.time() - t0, "t0": t0,
            "ring_started_s": ring_started, "unjudged_polls": unjudged,
            "read_fleet_s": sorted(reads)[len(reads) // 2] if reads else None}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        sys.exit("usage: fleet_sim.py worker SPEC.json (the fleet is driven by benchmarks/fleet.py)")
    worker(Path(sys.argv[2]))
