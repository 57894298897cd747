"""Evaluate the exported ONNX policy — the artifact that ships — over a scenario suite in the twin.

Every scenario × shard is a seeded batch of parallel episodes (a unit a flow fans out through its
task runner); shard k of every scenario has seed ``cfg.seed + k``, so scenarios share initial states,
and the champion runs the same shards, which pairs its episodes with the challenger's. With a
stand-in reference robot, the nominal episodes also run on it and on the uncalibrated model:
the sim-to-real check says how far each model's prediction is from the robot.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edge.bundle import sha256_path
from edge.runtime import OnnxRuntime
from stages.artifacts import EvalReport, ExportedPolicy, ScenarioResult, TwinSpec, atomic_dir
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.twin import report as html_report
from stages.twin.episodes import Episodes, run_episodes
from stages.twin.gate import GateConfig, check_metric_names, floor_checks, metric_checks, suite_checks
from stages.twin.stats import bootstrap_mean, metric_intervals, wilson
from stages.twin.suite import NOMINAL, Scenario, Suite, load_suite, suite_path


class EvalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    episodes: Optional[int] = Field(None, ge=1, description="Seeded episodes per scenario (None: the suite's).")
    seed: int = Field(1000, description="Seed of initial states (disjoint from training seeds).")
    shards: int = Field(1, ge=1, description="Batches each scenario's episodes are split into (units of fan-out).")
    suite: Optional[Path] = Field(None, description="Scenario suite file (None: the task's own, else the default).")
    video: bool = Field(True, description="Render the nominal and the worst episode into the report.")

    def load_suite(self, task_ref: str) -> Suite:
        suite = load_suite(self.suite or suite_path(load(task_ref).name))
        return suite.model_copy(update={"episodes": self.episodes}) if self.episodes else suite


class ShardJob(BaseModel):
    """One batch of episodes: a policy, a scenario, a seed, a count."""

    model_config = ConfigDict(frozen=True)
    onnx: Path
    scenario: Scenario
    seed: int
    episodes: int


class Trajectory(BaseModel):
    """One episode's joint positions, to render."""

    model_config = ConfigDict(frozen=True)
    scenario: str
    seed: int
    episode: int
    episode_return: float
    qpos: list[list[float]]
    mocap: list[list[float]] | None = None
    """Mocap body positions per step (the task's goal marker), when the task has one."""


class Shard(BaseModel):
    """A shard's per-episode metrics (see :class:`stages.twin.episodes.Episodes`)."""

    model_config = ConfigDict(frozen=True)
    scenario: str
    returns: tuple[float, ...]
    success: tuple[bool, ...]
    fell: tuple[bool, ...]
    steps: tuple[int, ...]
    nan_actions: tuple[int, ...]
    limit_steps: tuple[int, ...]
    saturated: tuple[float, ...]
    smoothness: tuple[float, ...]
    latency_ms: tuple[float, ...]
    first: Trajectory
    worst: Trajectory
    metrics: dict[str, tuple[float, ...]] = Field(default_factory=dict)
    """{name: per-episode value} of the task's metrics (``Task.metrics``), each averaged over its episode."""


def shard_jobs(cfg: EvalConfig, suite: Suite, onnx: Path) -> list[ShardJob]:
    """Each scenario's episodes split into ``cfg.shards`` seeded batches (shard k has seed ``cfg.seed + k``)."""
    sizes = [len(p) for p in np.array_split(np.arange(suite.episodes), min(cfg.shards, suite.episodes))]
    return [ShardJob(onnx=onnx, scenario=s, seed=cfg.seed + k, episodes=n)
            for s in suite.scenarios for k, n in enumerate(sizes)]


def episodes_in(onnx: Path, task_ref: str, scenario: Scenario, params: PhysicalParams, seed: int, n: int) -> Episodes:
    """``n`` seeded episodes of ``scenario`` around ``params`` through the device runtime code."""
    env = BatchedEnv(load(task_ref), n, params=scenario.params(params), seed=seed, disturbance=scenario.disturbance)
    return run_episodes(OnnxRuntime(onnx), env)


def run_shard(job: ShardJob, task_ref: str, params: PhysicalParams) -> Shard:
    """Run one shard's episodes in the twin (``params``) shifted by the job's scenario."""
    e = episodes_in(job.onnx, task_ref, job.scenario, params, job.seed, job.episodes)

    def trajectory(i: int) -> Trajectory:
        return Trajectory(scenario=job.scenario.name, seed=job.seed, episode=i, episode_return=float(e.returns[i]),
                          qpos=e.qpos[: e.steps[i], i].tolist(),
                          mocap=None if e.mocap is None else e.mocap[: e.steps[i], i].tolist())

    return Shard(scenario=job.scenario.name, returns=tuple(e.returns.tolist()), success=tuple(e.success.tolist()),
                 fell=tuple(e.fell.tolist()), steps=tuple(e.steps.tolist()), nan_actions=tuple(e.nan_actions.tolist()),
                 limit_steps=tuple(e.limit_steps.tolist()), saturated=tuple(e.saturated.tolist()),
                 smoothness=tuple(e.smoothness.tolist()), latency_ms=tuple(e.latency_ms.tolist()),
                 first=trajectory(0), worst=trajectory(int(np.argmin(e.returns))),
                 metrics={name: tuple(v.tolist()) for name, v in e.metrics.items()})


def _column(shards: list[Shard], name: str) -> np.ndarray:
    return np.concatenate([np.asarray(getattr(s, name), dtype=float) for s in shards])


def metric_summary(shards: list[Shard], seed: int) -> dict[str, dict]:
    """{name: {"mean", "ci95"}} of each task metric over the scenario's episodes (a bootstrap interval)."""
    return metric_intervals({name: np.concatenate([np.asarray(s.metrics[name], dtype=float) for s in shards])
                             for name in shards[0].metrics}, seed)


def summarize(name: str, shards: list[Shard], seed: int) -> dict:
    """Per-scenario metrics with intervals and safety counts."""
    returns, success, steps = _column(shards, "returns"), _column(shards, "success"), _column(shards, "steps")
    latency = _column(shards, "latency_ms")
    return {
        "scenario": name, "episodes": len(returns),
        "success_rate": float(success.mean()), "success_rate_ci95": list(wilson(int(success.sum()), len(success))),
        "mean_return": float(returns.mean()), "mean_return_ci95": list(bootstrap_mean(returns, seed=seed)),
        "return_std": float(returns.std()), "falls": int(_column(shards, "fell").sum()),
        "nan_actions": int(_column(shards, "nan_actions").sum()), "steps": int(steps.sum()),
        "joint_limit_fraction": float(_column(shards, "limit_steps").sum() / steps.sum()),
        "saturation_fraction": float((_column(shards, "saturated") * steps).sum() / steps.sum()),
        "smoothness": float(_column(shards, "smoothness").mean()),
        "latency_ms_p50": float(np.percentile(latency, 50)), "latency_ms_p99": float(np.percentile(latency, 99)),
        "metrics": metric_summary(shards, seed),
    }


def by_scenario(shards: list[Shard]) -> dict[str, list[Shard]]:
    out: dict[str, list[Shard]] = {}
    for s in shards:
        out.setdefault(s.scenario, []).append(s)
    return out


class Champion(BaseModel):
    """The current champion's exported ONNX, evaluated on the same seeds for a paired comparison."""

    model_config = ConfigDict(frozen=True)
    version: str
    onnx: Path


def sim_to_real(onnx: Path, task_ref: str, twin: PhysicalParams, reference: PhysicalParams, suite: Suite,
                seed: int) -> dict:
    """Nominal episodes on the reference robot, the twin and the uncalibrated model, same seeds.

    The gap of a model is how far its prediction is from the robot: the paired per-episode return
    difference and the RMS difference of the robot's joint trajectories (closed loop)."""
    task = load(task_ref)
    nominal = Scenario(name=NOMINAL)
    robot = episodes_in(onnx, task_ref, nominal, reference, seed, suite.episodes)
    out = {"reference": {"label": "stand-in (reference robot)", "mean_return": float(robot.returns.mean()),
                         "success_rate": float(robot.success.mean())}}
    for name, params in (("twin", twin), ("uncalibrated", task.nominal_params())):
        e = episodes_in(onnx, task_ref, nominal, params, seed, suite.episodes)
        t = min(len(e.qpos), len(robot.qpos))
        alive = (np.arange(t)[:, None] < np.minimum(e.steps, robot.steps)[None, :])
        joints = task.replayed_qpos
        err = ((e.qpos[:t][..., joints] - robot.qpos[:t][..., joints]) ** 2).mean(axis=2)
        out[name] = {"mean_return": float(e.returns.mean()), "success_rate": float(e.success.mean()),
                     "return_gap": float(np.abs(e.returns - robot.returns).mean()),
                     "trajectory_rmse": float(np.sqrt(err[alive].mean()))}
    return out


def evaluate(cfg: EvalConfig, gate: GateConfig, policy: ExportedPolicy, twin: TwinSpec, out_dir: Path,
             champion: Champion | None = None, shards: list[Shard] | None = None,
             champion_shards: list[Shard] | None = None) -> EvalReport:
    """The suite in the twin (and the champion on the same seeds), gated; write ``report.json`` and ``report.html``.

    ``shards`` / ``champion_shards``: results of :func:`shard_jobs` already run elsewhere (a fan-out);
    by default they run here, one after another."""
    suite = cfg.load_suite(policy.task)
    task = load(policy.task)
    check_metric_names([*gate.metric_limits, *(n for sc in suite.scenarios for n in sc.metric_limits)], task)
    period = task.ctrl_dt
    shards = shards or [run_shard(j, policy.task, twin.params) for j in shard_jobs(cfg, suite, policy.path)]
    if champion is not None and not champion_shards:
        champion_shards = [run_shard(j, policy.task, twin.params) for j in shard_jobs(cfg, suite, champion.onnx)]
    mine, theirs = by_scenario(shards), by_scenario(champion_shards or [])
    scenarios, checks, diffs = [], [], []
    for sc in suite.scenarios:
        row = summarize(sc.name, mine[sc.name], cfg.seed)
        if sc.name in theirs:
            base = summarize(sc.name, theirs[sc.name], cfg.seed)
            diff = _column(mine[sc.name], "returns") - _column(theirs[sc.name], "returns")
            diffs.append(diff)
            row["champion"] = {k: base[k] for k in ("success_rate", "success_rate_ci95", "mean_return", "mean_return_ci95")}
            row["champion"]["mean_difference"] = float(diff.mean())
        checks += floor_checks(sc.name, row["success_rate_ci95"][0],
                               sc.min_success_rate if sc.min_success_rate is not None else gate.min_success_rate,
                               row["mean_return_ci95"][0],
                               sc.min_mean_return if sc.min_mean_return is not None else gate.min_mean_return)
        checks += metric_checks(sc.name, task.metrics, {k: v["ci95"] for k, v in row["metrics"].items()},
                                {**gate.metric_limits, **sc.metric_limits})
        scenarios.append(row)
    paired = bootstrap_mean(np.concatenate(diffs), seed=cfg.seed) if diffs else None
    latency = np.concatenate([s.latency_ms for s in shards])
    latency_p50, latency_p99 = (float(v) for v in np.percentile(latency, [50, 99]))
    steps = sum(r["steps"] for r in scenarios)
    checks += suite_checks(gate, sum(r["nan_actions"] for r in scenarios),
                           sum(r["joint_limit_fraction"] * r["steps"] for r in scenarios) / steps,
                           sum(r["saturation_fraction"] * r["steps"] for r in scenarios) / steps,
                           latency_p99, period, paired[0] if paired else None)
    reference = twin.standin_truth
    check = sim_to_real(policy.path, policy.task, twin.params, reference, suite, cfg.seed) if reference else None
    passed, reasons = all(c.passed for c in checks), tuple(c.reason() for c in checks)
    head = scenarios[0]
    report = {
        "task": policy.task, "twin_digest": twin.digest, "policy_digest": policy.digest, "seed": cfg.seed,
        "suite": suite.model_dump(mode="json"), "control_period_s": period,
        "latency_ms_p50": latency_p50, "latency_ms_p99": latency_p99,
        "metrics": [asdict(m) for m in task.metrics], "scenarios": scenarios,
        "champion": None if champion is None else {"version": champion.version, "paired_difference_ci95": list(paired)},
        "sim_to_real": check, "gate": gate.model_dump(), "checks": [c.model_dump() for c in checks],
        "passed": passed, "reasons": list(reasons),
    }
    worst = min((s.worst for s in shards), key=lambda t: t.episode_return)
    first = next(s.first for s in shards if s.scenario == NOMINAL)
    with atomic_dir(out_dir) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
        html_report.write(report, policy.task, [("nominal episode", first), ("worst episode", worst)] if cfg.video else [],
                          tmp, champion.version if champion else None)
    path = out_dir / "report.json"
    return EvalReport(
        path=path, digest=sha256_path(path), html=out_dir / "report.html", episodes=sum(r["episodes"] for r in scenarios),
        success_rate=head["success_rate"], mean_return=head["mean_return"], passed=passed, reasons=reasons,
        scenarios=tuple(ScenarioResult(name=r["scenario"], success_rate=r["success_rate"], success_low=r["success_rate_ci95"][0],
                                       mean_return=r["mean_return"],
                                       champion_mean_return=r.get("champion", {}).get("mean_return"),
                                       champion_success_rate=r.get("champion", {}).get("success_rate"),
                                       metrics={k: v["mean"] for k, v in r["metrics"].items()})
                        for r in scenarios),
        latency_ms_p99=report["latency_ms_p99"],
        sim_to_real_gap={k: check[k]["trajectory_rmse"] for k in ("twin", "uncalibrated")} if check else None,
        champion_version=champion.version if champion else None,
        champion_mean_return=head.get("champion", {}).get("mean_return"),
        champion_success_rate=head.get("champion", {}).get("success_rate"))
