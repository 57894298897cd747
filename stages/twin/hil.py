"""Hardware-in-the-loop episodes: the twin runs on the host in real time, the device is the policy.

Each control period the host sends the twin's observation to the device (``sim2edge-agent run``,
wire format of ``edge.control``) and keeps integrating with the action in effect. An action takes
effect from the first physics substep after it arrives, as on a real actuator; an action that has
not arrived by the end of its period is a deadline miss (late if it arrives afterwards, lost if
never). The physics of a period is integrated once its own action arrived (nothing arriving later in
the period is newer) or when it ends, with the piecewise-constant controls the arrivals gave it, so
the result equals stepping substep by substep in real time; the next observation leaves on time.

Episodes use the scenarios, seeds and environment of in-process evaluation (one shard, seed
``cfg.seed``): episode i starts from row i's initial state of ``BatchedEnv(task, episodes, seed)``.
The twin's ``latency_steps`` is set to 0: the device and the link are the latency.

A device silent for ``dead_after_periods`` consecutive periods of an episode (killed, unplugged) stops
the run at once with ``DeviceFailed``; so does one that restarted: at the period its first actions come back
(``edge.control``'s FRESH flag), or, for an agent that does not send the flag, when its statistics after the
scenario show it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from edge.control import LATE, WATCHDOG
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.sim.task import Task
from stages.twin.hil_link import Arrival, DeviceFailed, DeviceLink, Phase, align
from stages.twin.hil_ros2 import RosLink
from stages.twin.stats import bootstrap_mean, metric_intervals, wilson
from stages.twin.suite import NOMINAL, Scenario


class HilConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str = Field(description="The device's address: udp://HOST:PORT or unix:///PATH.")
    episodes: int = Field(4, ge=1, description="Seeded episodes (one shard of in-process evaluation's seeds).")
    seed: int = Field(1000, description="Seed of initial states, as in EvalConfig.")
    max_steps: Optional[int] = Field(None, ge=1, description="Control steps per episode (None: the task's).")
    probes: int = Field(10, ge=1, description="Probe observations measuring the device's tick phase per episode.")
    lead: float = Field(0.25, ge=0, lt=1, description="Send each observation this fraction of a period before the "
                                                     "device's tick.")
    grace_s: float = Field(0.2, ge=0, description="After an episode, wait this long for late actions.")
    rows: tuple[int, ...] = Field((), description="Run only these episodes (rows of the shard, each < episodes; "
                                                  "empty: all), as a device's part of a sharded run.")
    dead_after_periods: int = Field(25, ge=2, description="Fail the run (DeviceFailed) once no action has arrived for "
                                    "this many consecutive periods of an episode (25: 0.5 s at 20 ms; a lossy link's "
                                    "burst stays far shorter: 15% loss each way loses 25 in a row with p ≈ 1e-14).")

    @model_validator(mode="after")
    def _rows(self) -> "HilConfig":
        if any(not 0 <= i < self.episodes for i in self.rows):
            raise ValueError(f"rows {list(self.rows)} must lie in 0..{self.episodes - 1}")
        return self


class HilEpisode(BaseModel):
    """One real-time episode: its outcome and what the link and the device did to its actions."""

    model_config = ConfigDict(frozen=True)
    episode: int
    episode_return: float
    success: bool
    fell: bool
    steps: int
    deadline_misses: int = Field(description="Periods whose action had not arrived when the period ended.")
    late_actions: int = Field(description="Actions that arrived after their period ended.")
    lost_actions: int = Field(description="Periods whose action never arrived (within the grace time).")
    duplicate_actions: int
    stale_actions: int = Field(description="Actions that arrived after a newer one (not applied).")
    watchdog_actions: int
    device_late: int = Field(description="Actions the device flagged LATE (its own deadline missed).")
    host_overruns: int = Field(description="Periods the host itself ended more than a period late (re-anchored).")
    rtt_ms: tuple[float, ...] = Field(description="Round trip of every arrived action, send to arrival.")
    phase: Phase
    metrics: dict[str, float] = Field(default_factory=dict, description="The task's metrics (``Task.metrics``), each "
                                                                        "averaged over the episode's control steps.")


class HilResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    task: str
    scenario: str
    period_s: float
    episodes: tuple[HilEpisode, ...]
    device_before: Optional[dict] = Field(None, description="The device's own statistics (S2S1) before the run.")
    device_after: Optional[dict] = Field(None, description="... and after it (None: it did not answer).")

    @property
    def returns(self) -> np.ndarray:
        return np.array([e.episode_return for e in self.episodes])

    def total(self, name: str) -> int:
        return int(sum(getattr(e, name) for e in self.episodes))

    def device_delta(self, counter: str) -> Optional[int]:
        """How much one of the device's counters (``edge.control.ControlLoop.stats``) grew during the run."""
        if self.device_before is None or self.device_after is None:
            return None
        return self.device_after[counter] - self.device_before[counter]

    def summary(self, seed: int = 0) -> dict:
        """One scenario's row, keyed like in-process evaluation's (``evaluate.summarize``) plus the link's counts."""
        success = np.array([e.success for e in self.episodes])
        rtt = self.rtt_ms()
        return {"scenario": self.scenario, "episodes": len(self.episodes),
                "success_rate": float(success.mean()), "success_rate_ci95": list(wilson(int(success.sum()), len(success))),
                "mean_return": float(self.returns.mean()),
                "mean_return_ci95": list(bootstrap_mean(self.returns, seed=seed)),
                "falls": self.total("fell"), "steps": self.total("steps"),
                **{k: self.total(k) for k in ("deadline_misses", "late_actions", "lost_actions", "duplicate_actions",
                                              "stale_actions", "host_overruns", "device_late")},
                "rtt_ms_p50": rtt["p50"], "rtt_ms_p99": rtt["p99"], "rtt_ms_max": rtt["max"],
                "metrics": metric_intervals({name: np.array([e.metrics[name] for e in self.episodes])
                                             for name in (self.episodes[0].metrics if self.episodes else {})}, seed)}

    def rtt_ms(self) -> dict[str, float]:
        """Round-trip p50, p99 and max over every episode (ms)."""
        rtt = np.concatenate([e.rtt_ms for e in self.episodes]) if any(e.rtt_ms for e in self.episodes) else None
        if rtt is None:
            return {"p50": math.nan, "p99": math.nan, "max": math.nan}
        return {"p50": float(np.percentile(rtt, 50)), "p99": float(np.percentile(rtt, 99)), "max": float(rtt.max())}


class Stopped(Exception):
    """The run was stopped from outside between two periods (another device of a sharded run failed)."""


def restarted(before: dict, after: dict) -> bool:
    """Whether the device's statistics (S2S1) went back between two reads: its uptime or its observation count."""
    return after.get("uptime_s", 0) < before.get("uptime_s", 0) or after.get("observations", 0) < before.get(
        "observations", 0)


def hil_task(task_ref: str, max_steps: Optional[int] = None) -> Task:
    """The registered task, its episodes cut to ``max_steps`` when given."""
    task = load(task_ref)
    return dataclasses.replace(task, episode_steps=max_steps) if max_steps else task


def open_link(address: str, task: Task) -> DeviceLink | RosLink:
    """The host's end of the link to the device at ``address``: datagrams (udp://, unix://) or ROS 2 (ros2://)."""
    if not address.startswith("ros2://"):
        return DeviceLink(address)
    try:
        return RosLink(address, task)
    except ImportError as e:
        raise DeviceFailed(f"{address}: {e}") from None


def twin_env(task: Task, scenario: Scenario, params: PhysicalParams, seed: int, n: int) -> BatchedEnv:
    """The environment in-process evaluation builds for one shard, with no simulated action latency."""
    shifted = scenario.params(params).model_copy(update={"latency_steps": 0})
    # one thread: no thread-pool hand-off in the real-time loop (the physics does not depend on it)
    return BatchedEnv(task, n, params=shifted, seed=seed, nthread=1, disturbance=scenario.disturbance)


def substep_actions(current: np.ndarray, changes: list[tuple[int, np.ndarray]],
                    substeps: int) -> tuple[np.ndarray, np.ndarray]:
    """Piecewise-constant actions of one period: ``current`` until each (substep, action) change, in order.

    Returns (substeps, nu) actions and the action in effect after the period (a change at or beyond
    ``substeps`` takes effect from the next period's first substep)."""
    out = np.empty((substeps, len(current)), np.float32)
    changes = list(changes)
    for s in range(substeps):
        while changes and changes[0][0] <= s:
            current = changes.pop(0)[1]
        out[s] = current
    return out, (changes[-1][1] if changes else current)


def run_hil(cfg: HilConfig, task_ref: str, scenario: Scenario = Scenario(name=NOMINAL),
            params: Optional[PhysicalParams] = None, stop: Optional[threading.Event] = None) -> HilResult:
    """``cfg.episodes`` real-time episodes (or its ``rows``) of ``scenario`` around ``params`` with the device at
    ``cfg.device``; DeviceFailed naming it, the scenario, episode and step when it falls silent (or restarted),
    Stopped when ``stop`` is set."""
    task = hil_task(task_ref, cfg.max_steps)
    params = params or task.nominal_params()
    link = open_link(cfg.device, task)
    seq, episodes = 1, []
    try:
        before = link.stats()
        for i in cfg.rows or range(cfg.episodes):
            env = twin_env(task, scenario, params, cfg.seed, cfg.episodes)
            obs = env.reset()[i]
            phase = align(link, obs, task.ctrl_dt, seq, cfg.probes, cfg.lead * task.ctrl_dt)
            seq += cfg.probes
            where = f"{cfg.device}: scenario {scenario.name!r}, episode {i}"
            episode, seq = _episode(link, env, i, obs, phase, seq, cfg.grace_s, _Watch(where, cfg.dead_after_periods,
                                                                                          stop, link))
            episodes.append(episode)
        after = link.stats()
    finally:
        link.close()
    if before is not None and after is not None and restarted(before, after):
        raise DeviceFailed(f"{cfg.device}: restarted during scenario {scenario.name!r} (uptime {after.get('uptime_s')} "
                           f"s, {after.get('observations')} observations; before: {before.get('uptime_s')} s, "
                           f"{before.get('observations')})")
    return HilResult(task=task.name, scenario=scenario.name, period_s=task.ctrl_dt, episodes=tuple(episodes),
                     device_before=before, device_after=after)


@dataclasses.dataclass
class _Watch:
    """An episode's liveness watch: ``where`` it runs, silence allowed (periods), the outside stop, the link."""

    where: str
    dead_after: int
    stop: Optional[threading.Event]
    link: DeviceLink | RosLink
    silent: int = 0
    heard: float = 0.0

    def period(self, step: int, arrivals: list[Arrival], now: float) -> None:
        """Account one period's arrivals; DeviceFailed once silent ``dead_after`` periods or restarted, Stopped when
        stopped."""
        if (fresh := self.link.restart) is not None:
            raise DeviceFailed(f"{self.where}, step {step}: the device restarted (its first actions again, answering "
                               f"seq {fresh.seq} after {now - self.heard:.2f} s)")
        if arrivals:
            self.silent, self.heard = 0, arrivals[-1].at
        else:
            self.silent += 1
        if self.silent >= self.dead_after:
            raise DeviceFailed(f"{self.where}, step {step}: no action for {self.silent} periods "
                               f"({now - self.heard:.2f} s); the device stopped answering")
        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"{self.where}, step {step}: stopped")


def _episode(link: DeviceLink | RosLink, env: BatchedEnv, row: int, obs: np.ndarray, phase: Phase, seq: int,
             grace_s: float, watch: _Watch) -> tuple[HilEpisode, int]:
    """Row ``row`` of ``env`` in real time, the other rows idle; returns the episode and the next seq."""
    task, period, substep = env.task, env.task.ctrl_dt, env.task.model.opt.timestep
    idle = np.zeros((env.num_envs, task.decimation, env.nu), np.float32)  # the other rows hold a zero action
    deadline: dict[int, float] = {}  # seq → the end of its period
    on_time, arrived = set(), set()
    counts = dict(duplicate_actions=0, stale_actions=0, watchdog_actions=0, device_late=0, host_overruns=0)
    rtt: list[float] = []
    current, applied_seq = np.zeros(env.nu, np.float32), 0
    now = time.monotonic()
    start = now + (phase.send_phase_s - now) % period
    link.receive(start)  # stray replies to the probes
    watch.heard = time.monotonic()
    episode_return, success, fell, steps = 0.0, False, False, 0
    metric_sums = {m.name: 0.0 for m in task.metrics}

    def take(arrivals, period_start: float) -> list[tuple[int, np.ndarray]]:
        """Account for arrivals; the applied ones as (substep from ``period_start``, normalized action)."""
        nonlocal applied_seq
        changes = []
        for a in arrivals:
            if a.flags & WATCHDOG:
                counts["watchdog_actions"] += 1
                continue
            if a.seq not in deadline:
                continue  # a probe's reply
            if a.seq in arrived:
                counts["duplicate_actions"] += 1
                continue
            arrived.add(a.seq)
            rtt.append((a.at - a.stamp) * 1e3)
            counts["device_late"] += bool(a.flags & LATE)
            if a.at <= deadline[a.seq]:
                on_time.add(a.seq)
            if a.seq < applied_seq:
                counts["stale_actions"] += 1
                continue
            applied_seq = a.seq
            # the graph outputs actuator controls; the env takes normalized actions, as in run_episodes
            action = np.clip((np.nan_to_num(a.values) - task.action_default) / task.action_scale, -1.0, 1.0)
            changes.append((math.ceil((a.at - period_start) / substep - 1e-9), action.astype(np.float32)))
        return changes

    t, pending = start, []
    for k in range(task.episode_steps):
        # arrivals while waiting for the period to start: the last period is integrated, they apply from now
        early = link.receive(t)
        pending += [(0, a) for _, a in take(early, t)]
        deadline[seq] = t + period
        link.send_observation(seq, obs)
        # the period's physics is settled once its own action arrived (anything later is older or a copy)
        arrivals = link.receive(t + period, awaited=seq)
        watch.period(k, early + arrivals, time.monotonic())
        changes = pending + take(arrivals, t)
        seq, pending = seq + 1, []
        per_substep, current = substep_actions(current, changes, task.decimation)
        substeps = idle.copy()
        substeps[row] = per_substep
        r = env.step(substeps[:, -1], substeps=substeps)
        steps = k + 1
        for name, value in r.metrics.items():
            metric_sums[name] += float(value[row])
        if r.done[row]:
            i = list(np.flatnonzero(r.done)).index(row)
            episode_return, success, fell = float(r.finished_returns[i]), bool(r.finished_success[i]), bool(r.terminated[row])
            break
        obs = r.obs[row]
        t += period
        if time.monotonic() - t > period:  # the host fell behind: count it and start the next period now
            counts["host_overruns"] += 1
            t = time.monotonic()
    take(link.receive(time.monotonic() + grace_s), time.monotonic())
    misses = len(deadline) - len(on_time)
    lost = len(deadline) - len(arrived)
    return HilEpisode(episode=row, episode_return=episode_return, success=success, fell=fell, steps=steps,
                      deadline_misses=misses, late_actions=misses - lost, lost_actions=lost, rtt_ms=tuple(rtt),
                      phase=phase, metrics={name: total / max(steps, 1) for name, total in metric_sums.items()},
                      **counts), seq
