"""The scenario suite over hardware-in-the-loop, beside in-process evaluation on the same seeds, gated.

Every scenario runs twice on the same initial states (one shard, seed ``cfg.seed``): in-process,
through ``edge.runtime`` as evaluation does, and in real time against the device (``run_hil``).
With several devices the suite's (scenario, episode) work is cut into one contiguous part per
device, run concurrently, and merged back into suite and seed order (``run_shards``). The
HIL gate adds floors on what only the link and the device can do wrong: deadline misses per
scenario, the round-trip p99 against a fraction of the control period, and HIL returns
non-inferior to in-process returns (the paired per-episode difference over the suite). A
scenario's ``extra_latency_steps`` applies in-process only: over HIL the link is the latency.

The pipeline's ``hil_evaluate`` stage (``stages.twin.hil_stage``) runs it on the packaged bundle
after ``package`` when ``hil`` is set in its parameters; a failing HIL gate keeps the version a challenger.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from edge.runtime import OnnxRuntime
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.task import Metric
from stages.twin.episodes import run_episodes
from stages.twin.gate import Check, check_metric_names, metric_checks
from stages.twin.hil import HilConfig, HilResult, Stopped, hil_task, restarted, run_hil
from stages.twin.hil_link import DeviceFailed, DeviceLink, parse_address
from stages.twin.hil_ros2 import parse_topics
from stages.twin.stats import bootstrap_mean, metric_intervals, wilson
from stages.twin.suite import Scenario, load_suite, suite_path


class HilGateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_deadline_miss_fraction: float = Field(0.05, ge=0, le=1, description="Ceiling, per scenario, on the fraction "
                                              "of control periods whose action had not arrived when the period ended.")
    max_round_trip_fraction: float = Field(1.0, gt=0, description="The round-trip p99 over the suite must stay "
                                           "below this fraction of the control period (the round trip includes the "
                                           "wait for the device's tick, HilConfig.lead of a period).")
    return_margin: float = Field(10.0, ge=0, description="HIL against in-process on the same seeds: the lower 95% "
                                 "bound of the mean paired return difference (HIL − in-process) must be ≥ −margin.")
    metric_limits: dict[str, float] = Field(default_factory=dict, description="Limit per task metric (by name) on "
                                            "each scenario's HIL 95% interval, on its worse side (a ceiling for a "
                                            "metric better lower); a scenario's own `metric_limits` in the suite "
                                            "override it, as in the in-process gate.")


def load_gate(path: Optional[Path]) -> HilGateConfig:
    """The HIL gate of a YAML file of HilGateConfig's keys (None: the defaults); ValueError in one line naming it."""
    if path is None:
        return HilGateConfig()
    try:
        return HilGateConfig(**(yaml.safe_load(path.read_text()) or {}))
    except (OSError, yaml.YAMLError, TypeError) as e:
        raise ValueError(f"HIL gate {path}: {str(e).splitlines()[0]}") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"HIL gate {path}: {'.'.join(map(str, err['loc']))}: {err['msg']} "
                         f"(allowed: {', '.join(HilGateConfig.model_fields)})") from None


def check_devices(devices: tuple[str, ...]) -> tuple[str, ...]:
    """``devices`` if each is a device address, none twice; else ValueError naming the first that is not."""
    for device in devices:
        parse_topics(device) if device.startswith("ros2:") else parse_address(device)
    twice = [d for d in devices if devices.count(d) > 1]
    if twice:
        raise ValueError(f"device {twice[0]} is given twice")
    return devices


class HilSuiteConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    devices: tuple[str, ...] = Field(min_length=1, description="The devices' addresses, udp://HOST:PORT or "
                                     "unix:///PATH, each serving the policy; the suite is sharded across them.")
    episodes: int = Field(4, ge=1, description="Seeded episodes per scenario (real time: each lasts its task's "
                                               "episode length).")
    seed: int = Field(1000, description="Seed of initial states, as in EvalConfig (one shard).")
    max_steps: Optional[int] = Field(None, ge=1, description="Control steps per episode (None: the task's).")
    suite: Optional[Path] = Field(None, description="Scenario suite file (None: the task's own, else the default).")
    scenarios: tuple[str, ...] = Field((), description="Run only these scenarios of the suite (empty: all).")
    dead_after_periods: int = HilConfig.model_fields["dead_after_periods"]

    @field_validator("devices")
    @classmethod
    def _addresses(cls, devices: tuple[str, ...]) -> tuple[str, ...]:
        return check_devices(devices)

    def hil(self, device: str, rows: tuple[int, ...]) -> HilConfig:
        """The real-time run of ``rows`` of a scenario's episodes on ``device``."""
        return HilConfig(device=device, episodes=self.episodes, seed=self.seed, max_steps=self.max_steps, rows=rows,
                         dead_after_periods=self.dead_after_periods)

    def select(self, task_ref: str) -> tuple[Scenario, ...]:
        """The suite's scenarios to run; an unknown name raises ValueError naming it and the suite's."""
        suite = load_suite(self.suite or suite_path(hil_task(task_ref).name))
        names = [s.name for s in suite.scenarios]
        unknown = [n for n in self.scenarios if n not in names]
        if unknown:
            raise ValueError(f"scenario {unknown[0]!r} is not in the suite ({', '.join(names)})")
        return tuple(s for s in suite.scenarios if not self.scenarios or s.name in self.scenarios)


class HilReport(BaseModel):
    """Per scenario the in-process and HIL rows side by side; the HIL gate's clauses."""

    model_config = ConfigDict(frozen=True)
    task: str
    device: str = Field(description="The device's address; several comma-separated when the suite was sharded "
                                    "(each scenario's ``shards`` say which ran what).")
    seed: int
    period_s: float
    scenarios: tuple[dict, ...]
    round_trip_ms_p99: float
    paired_difference_ci95: tuple[float, float]
    gate: HilGateConfig
    checks: tuple[Check, ...]
    device_runtime: Optional[str] = Field(None, description="The runtime the device chose, e.g. 'onnxruntime "
                                          "(CPUExecutionProvider)', from its statistics (None: it did not say); "
                                          "the distinct ones, '; '-separated, over several devices.")

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({**self.model_dump(mode="json"), "passed": self.passed}, indent=2)


def in_process(onnx: Path, task_ref: str, scenario: Scenario, params: PhysicalParams, cfg: HilSuiteConfig) -> dict:
    """``cfg.episodes`` of ``scenario`` through the device runtime code, in-process, on the HIL episodes' seeds."""
    env = BatchedEnv(hil_task(task_ref, cfg.max_steps), cfg.episodes, params=scenario.params(params), seed=cfg.seed,
                     disturbance=scenario.disturbance)
    e = run_episodes(OnnxRuntime(onnx), env)
    return {"returns": e.returns.tolist(), "success_rate": float(e.success.mean()),
            "success_rate_ci95": list(wilson(int(e.success.sum()), len(e.success))),
            "mean_return": float(e.returns.mean()), "mean_return_ci95": list(bootstrap_mean(e.returns, seed=cfg.seed)),
            "falls": int(e.fell.sum()), "metrics": metric_intervals(e.metrics, cfg.seed)}


def device_counters(r: HilResult) -> Optional[dict]:
    """How much each of the device's counters grew during the scenario, and its act() timing after it."""
    if r.device_before is None or r.device_after is None:
        return None
    grown = {k: r.device_delta(k) for k, v in r.device_after.items() if isinstance(v, int) and not isinstance(v, bool)}
    return {**grown, **{k: r.device_after[k] for k in ("act_p50_us", "act_p99_us", "wake_late_p99_us")}}


def merged_counters(parts: list[Optional[dict]]) -> Optional[dict]:
    """The counters of the devices that ran a scenario summed, their act()/wake-up percentiles the worst of them."""
    if not parts or any(p is None for p in parts):
        return None
    return {k: max((p[k] for p in parts if p[k] is not None), default=None) if k.endswith("_us")
            else sum(p[k] for p in parts) for k in parts[0]}


def runtime_of(stats: dict) -> Optional[str]:
    """The runtime serving on the device and its providers, as its statistics (S2S1) name them."""
    if "runtime" not in stats:
        return None
    return f"{stats['runtime']} ({', '.join(stats.get('providers', []))})"


def served(stats: dict) -> str:
    """The policy, version and graph a device serves, as its statistics (S2S1) name them."""
    return f"{stats.get('policy', '?')} v{stats.get('version', '?')} (graph {str(stats.get('graph_sha256', '?'))[:12]})"


def device_stats(devices: tuple[str, ...], graph_sha256: Optional[str] = None) -> dict[str, dict]:
    """Each device's statistics (S2S1), asked concurrently; DeviceFailed naming a device that does not answer, and
    ValueError naming each device's policy when they do not all serve the same graph, or not ``graph_sha256`` (the
    sha256 of the bundle's ``policy.onnx`` under evaluation) when given: two bundles with one name and version are
    told apart by their graphs. A ROS 2 device has no statistics request: it is {} and goes unchecked."""
    def ask(device: str) -> dict:
        if device.startswith("ros2://"):
            return {}
        link = DeviceLink(device)
        try:
            stats = link.stats()
        except OSError as e:
            raise DeviceFailed(f"{device}: {e}") from None
        finally:
            link.close()
        if stats is None:
            raise DeviceFailed(f"{device}: no answer to its statistics requests (S2S1)")
        return stats

    with ThreadPoolExecutor(len(devices)) as pool:
        stats = dict(zip(devices, pool.map(ask, devices)))
    known = {d: s for d, s in stats.items() if s}
    if len({served(s) for s in known.values()}) > 1:
        raise ValueError("the devices serve different policies: " + ", ".join(f"{d} serves {served(s)}"
                                                                             for d, s in known.items()))
    other = [d for d, s in known.items() if graph_sha256 and s.get("graph_sha256") != graph_sha256]
    if other:
        raise ValueError(f"{other[0]} serves {served(stats[other[0]])}, not the bundle under evaluation "
                         f"(graph {graph_sha256[:12]})")
    return stats


def shards(scenarios: int, episodes: int, devices: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """The suite's (scenario, episode) work, in suite and seed order, cut into ``devices`` contiguous parts of
    near-equal size; each part as its (scenario index, episodes) groups."""
    work = [(s, e) for s in range(scenarios) for e in range(episodes)]
    cuts = np.linspace(0, len(work), devices + 1).round().astype(int)
    return [[(s, tuple(e for _, e in group)) for s, group in itertools.groupby(work[a:b], key=lambda w: w[0])]
            for a, b in zip(cuts, cuts[1:])]


def run_shards(cfg: HilSuiteConfig, task_ref: str, scenarios: tuple[Scenario, ...],
               params: PhysicalParams) -> list[list[tuple[str, HilResult]]]:
    """Per scenario, the (device, result) of each device that ran part of it, the devices running concurrently.

    One thread per device suffices: a device's thread spends its control periods waiting in ``select`` and
    integrating the twin with ``mujoco.rollout``, both outside the GIL, and its own Python work per period is
    well under a millisecond of a 20 ms period. When one device fails (or falls silent mid-episode) the others stop
    at their next period, and the first failure (in device order) is raised as DeviceFailed naming its address; so is
    a device whose statistics went back between two scenarios (it restarted)."""
    stop = threading.Event()

    def run(device: str, part: list[tuple[int, tuple[int, ...]]]) -> list[tuple[int, HilResult]]:
        done: list[tuple[int, HilResult]] = []
        try:
            for s, rows in part:
                if stop.is_set():
                    break
                r = run_hil(cfg.hil(device, rows), task_ref, scenarios[s], params, stop)
                last = done[-1][1].device_after if done else None
                if last is not None and r.device_before is not None and restarted(last, r.device_before):
                    raise DeviceFailed(f"{device}: restarted before scenario {scenarios[s].name!r} (uptime "
                                       f"{r.device_before.get('uptime_s')} s after {last.get('uptime_s')} s)")
                done.append((s, r))
        except Stopped:
            pass  # another device failed: its failure is raised below
        except Exception as e:
            stop.set()
            if isinstance(e, OSError) and not isinstance(e, DeviceFailed):
                raise DeviceFailed(f"{device}: {e}") from None
            raise
        return done

    with ThreadPoolExecutor(len(cfg.devices)) as pool:
        futures = [pool.submit(run, d, p) for d, p in zip(cfg.devices, shards(len(scenarios), cfg.episodes,
                                                                              len(cfg.devices)))]
    per_scenario: list[list[tuple[str, HilResult]]] = [[] for _ in scenarios]
    for device, future in zip(cfg.devices, futures):
        for s, result in future.result():
            per_scenario[s].append((device, result))
    return per_scenario


def merge(parts: list[tuple[str, HilResult]]) -> HilResult:
    """One scenario's results from its devices as one result, episodes in seed order (no device statistics)."""
    first = parts[0][1]
    episodes = sorted((e for _, r in parts for e in r.episodes), key=lambda e: e.episode)
    return HilResult(task=first.task, scenario=first.scenario, period_s=first.period_s, episodes=tuple(episodes))


def shard_rows(parts: list[tuple[str, HilResult]]) -> list[dict]:
    """Which device ran which episodes of a scenario, with its runtime, policy and own counters over them."""
    return [{"device": device, "episodes": [e.episode for e in r.episodes],
             "policy": served(r.device_after or r.device_before or {}),
             "runtime": runtime_of(r.device_after or r.device_before or {}), "counters": device_counters(r)}
            for device, r in parts]


def hil_checks(gate: HilGateConfig, rows: list[dict], scenarios: tuple[Scenario, ...], metrics: tuple[Metric, ...],
               rtt_p99_ms: float, period_s: float, paired_low: float) -> list[Check]:
    """Deadline misses and task metric limits per scenario; the round-trip budget and paired non-inferiority over
    the suite."""
    checks = []
    for r, sc in zip(rows, scenarios):
        checks.append(Check(name=f"{r['scenario']}: HIL deadline-miss fraction",
                            passed=r["hil"]["deadline_miss_fraction"] <= gate.max_deadline_miss_fraction,
                            detail=f"{r['hil']['deadline_miss_fraction']:.3f} <= {gate.max_deadline_miss_fraction}"))
        ci95 = {name: m["ci95"] for name, m in r["hil"]["metrics"].items()}
        checks += metric_checks(f"{r['scenario']}: HIL", metrics, ci95, {**gate.metric_limits, **sc.metric_limits})
    budget_ms = gate.max_round_trip_fraction * period_s * 1e3
    checks.append(Check(name="HIL round-trip p99", passed=rtt_p99_ms < budget_ms,
                        detail=f"{rtt_p99_ms:.1f} ms < {budget_ms:.1f} ms"))
    checks.append(Check(name="HIL vs in-process paired return difference lower 95% bound",
                        passed=paired_low >= -gate.return_margin, detail=f"{paired_low:.1f} >= -{gate.return_margin}"))
    return checks


def hil_evaluate(cfg: HilSuiteConfig, gate: HilGateConfig, onnx: Path, task_ref: str,
                 params: Optional[PhysicalParams] = None, graph_sha256: Optional[str] = None) -> HilReport:
    """Each selected scenario in-process and over HIL on the same seeds (sharded across ``cfg.devices``, after each
    device answered and all serve the same graph: ``graph_sha256``, the bundle's, when given); the HIL gate over the
    results."""
    task = hil_task(task_ref, cfg.max_steps)
    params = params or task.nominal_params()
    scenarios = cfg.select(task_ref)
    check_metric_names([*gate.metric_limits, *(n for sc in scenarios for n in sc.metric_limits)], task)
    stats = device_stats(cfg.devices, graph_sha256)
    bases = [in_process(onnx, task_ref, sc, params, cfg) for sc in scenarios]
    rows, diffs, rtts = [], [], []
    for sc, base, parts in zip(scenarios, bases, run_shards(cfg, task_ref, scenarios, params)):
        hil = merge(parts)
        row = hil.summary(cfg.seed)
        row["deadline_miss_fraction"] = row["deadline_misses"] / max(sum(e.steps for e in hil.episodes), 1)
        diffs.append(hil.returns - np.asarray(base.pop("returns")))
        rtts += [t for e in hil.episodes for t in e.rtt_ms]
        rows.append({"scenario": sc.name, "in_process": base, "hil": row,
                     "device": merged_counters([device_counters(r) for _, r in parts]), "shards": shard_rows(parts)})
    paired = bootstrap_mean(np.concatenate(diffs), seed=cfg.seed)
    rtt_p99 = float(np.percentile(rtts, 99)) if rtts else math.nan
    runtimes = "; ".join(dict.fromkeys(r for r in map(runtime_of, stats.values()) if r)) or None
    return HilReport(task=task.name, device=", ".join(cfg.devices), seed=cfg.seed, period_s=task.ctrl_dt,
                     scenarios=tuple(rows), round_trip_ms_p99=rtt_p99, paired_difference_ci95=tuple(paired), gate=gate,
                     checks=tuple(hil_checks(gate, rows, scenarios, task.metrics, rtt_p99, task.ctrl_dt,
                                                       paired[0])), device_runtime=runtimes)
