"""Evaluate the exported ONNX policy — the artifact that ships — in the twin, seeded.

Episodes run in shards (each a seeded batch of parallel environments), so a flow can fan
them out through its task runner; the champion runs the same shards with the same seeds,
which pairs its episodes with the challenger's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from edge.bundle import sha256_path
from edge.runtime import OnnxRuntime
from stages.artifacts import EvalReport, ExportedPolicy, TwinSpec, atomic_dir
from stages.sim.params import PhysicalParams
from stages.sim.env import BatchedEnv
from stages.sim.registry import load
from stages.twin.gate import GateConfig, decide
from stages.twin.stats import bootstrap_mean, wilson


class EvalConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    episodes: int = Field(32, ge=1, description="Seeded episodes, one per parallel environment.")
    seed: int = Field(1000, description="Seed of initial states (disjoint from training seeds).")
    shards: int = Field(4, ge=1, description="Batches the episodes are split into (units of fan-out).")


class ShardJob(BaseModel):
    """One batch of episodes: a policy, a seed, a count."""

    model_config = ConfigDict(frozen=True)
    onnx: Path
    seed: int
    episodes: int


class Shard(BaseModel):
    model_config = ConfigDict(frozen=True)
    returns: tuple[float, ...]
    success: tuple[bool, ...]
    nan_actions: int


def shard_jobs(cfg: EvalConfig, onnx: Path) -> list[ShardJob]:
    """The episodes split into ``cfg.shards`` seeded batches (shard k has seed ``cfg.seed + k``)."""
    sizes = [len(part) for part in np.array_split(np.arange(cfg.episodes), min(cfg.shards, cfg.episodes))]
    return [ShardJob(onnx=onnx, seed=cfg.seed + k, episodes=n) for k, n in enumerate(sizes)]


def run_shard(job: ShardJob, task_ref: str, params: PhysicalParams) -> Shard:
    """Run one shard's episodes in the twin with the policy through the device runtime code."""
    result = run_episodes(OnnxRuntime(job.onnx), BatchedEnv(load(task_ref), job.episodes, params=params, seed=job.seed))
    return Shard(returns=tuple(result["returns"].tolist()), success=tuple(result["success"].tolist()),
                 nan_actions=result["nan_actions"])


def _merge(shards: list[Shard]) -> dict:
    return {"returns": np.concatenate([s.returns for s in shards]), "success": np.concatenate([s.success for s in shards]),
            "nan_actions": sum(s.nan_actions for s in shards)}


def run_episodes(policy: OnnxRuntime, env: BatchedEnv) -> dict:
    """One episode per environment with the ONNX policy; returns per-episode arrays."""
    task = env.task
    n = env.num_envs
    returns, success, done = np.zeros(n), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    nan_actions = 0
    obs = env.reset()
    for _ in range(task.episode_steps):
        ctrl = policy.run(obs)
        nan_actions += int((~np.isfinite(ctrl)).any(axis=1)[~done].sum())
        # the graph outputs actuator controls; the env takes normalized actions
        action = (np.nan_to_num(ctrl) - task.action_default) / task.action_scale
        r = env.step(action)
        newly = np.flatnonzero(r.done)
        fresh = ~done[newly]
        returns[newly[fresh]] = r.finished_returns[fresh]
        success[newly[fresh]] = r.finished_success[fresh]
        done[newly] = True
        obs = r.obs
        if done.all():
            break
    return {"returns": returns, "success": success, "nan_actions": nan_actions}


class Champion(BaseModel):
    """The current champion's exported ONNX, evaluated on the same seeds for a paired comparison."""

    model_config = ConfigDict(frozen=True)
    version: str
    onnx: Path


def evaluate(cfg: EvalConfig, gate: GateConfig, policy: ExportedPolicy, twin: TwinSpec, out_dir: Path,
             champion: Champion | None = None, shards: list[Shard] | None = None,
             champion_shards: list[Shard] | None = None) -> EvalReport:
    """Seeded episodes in the twin (and the champion's on the same seeds); write ``report.json``.

    ``shards`` / ``champion_shards``: results of :func:`shard_jobs` already run elsewhere (a fan-out);
    by default they run here, one after another."""
    shards = shards or [run_shard(j, policy.task, twin.params) for j in shard_jobs(cfg, policy.path)]
    result = _merge(shards)
    success_rate, mean_return = float(result["success"].mean()), float(result["returns"].mean())
    success_ci = wilson(int(result["success"].sum()), cfg.episodes)
    return_ci = bootstrap_mean(result["returns"], seed=cfg.seed)
    comparison = None
    if champion is not None:
        base = _merge(champion_shards or [run_shard(j, policy.task, twin.params) for j in shard_jobs(cfg, champion.onnx)])
        diff = result["returns"] - base["returns"]
        comparison = {"champion_version": champion.version, "champion_mean_return": float(base["returns"].mean()),
                      "champion_success_rate": float(base["success"].mean()), "mean_difference": float(diff.mean()),
                      "difference_ci95": list(bootstrap_mean(diff, seed=cfg.seed))}
    passed, reasons = decide(gate, success_ci[0], return_ci[0], result["nan_actions"],
                             comparison["difference_ci95"][0] if comparison else None)
    report = {
        "task": policy.task,
        "twin_digest": twin.digest,
        "policy_digest": policy.digest,
        "episodes": cfg.episodes,
        "seed": cfg.seed,
        "success_rate": success_rate,
        "success_rate_ci95": list(success_ci),
        "mean_return": mean_return,
        "mean_return_ci95": list(return_ci),
        "return_std": float(result["returns"].std()),
        "nan_actions": result["nan_actions"],
        "champion": comparison,
        "gate": gate.model_dump(),
        "passed": passed,
        "reasons": list(reasons),
    }
    with atomic_dir(out_dir) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
    path = out_dir / "report.json"
    return EvalReport(path=path, digest=sha256_path(path), episodes=cfg.episodes, success_rate=success_rate,
                      mean_return=mean_return, passed=passed, reasons=reasons,
                      champion_version=champion.version if champion else None,
                      champion_mean_return=comparison["champion_mean_return"] if comparison else None,
                      champion_success_rate=comparison["champion_success_rate"] if comparison else None)
