"""Collect: roll out the reference robot stand-in and write a versioned log dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from stages import logs, standin
from edge.bundle import sha256_path
from stages.artifacts import Dataset, atomic_dir, sha256_json
from stages.sim.env import BatchedEnv
from stages.sim.registry import load


class CollectConfig(BaseModel):
    """How much stand-in data to record, and with which excitation."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    task: str = Field("cartpole", description="Registered task name or module:Class.")
    episodes: int = Field(16, ge=1, description="Episodes to record (each the task's episode length).")
    seed: int = Field(0, description="Seed of the excitation and the stand-in's noise.")
    smoothing: float = Field(0.8, ge=0, lt=1, description="AR(1) coefficient of the random excitation.")


def excitation(rng: np.random.Generator, steps: int, n: int, nu: int, smoothing: float) -> np.ndarray:
    """Smooth random actions in [-1, 1]: an AR(1) process, (steps, n, nu)."""
    out = np.zeros((steps, n, nu), dtype=np.float32)
    a = np.zeros((n, nu))
    for t in range(steps):
        a = smoothing * a + np.sqrt(1 - smoothing**2) * rng.standard_normal((n, nu))
        out[t] = np.clip(a, -1, 1)
    return out


def collect(cfg: CollectConfig, out_dir: Path) -> Dataset:
    """Record ``cfg.episodes`` stand-in episodes under random excitation into ``out_dir``."""
    task = load(cfg.task)
    hidden = standin.hidden_params(task.name)
    env = BatchedEnv(task, cfg.episodes, params=hidden, seed=cfg.seed, terminate=False)
    rng = np.random.default_rng(cfg.seed + 1)
    steps = task.episode_steps
    actions = excitation(rng, steps, cfg.episodes, task.act_dim, cfg.smoothing)
    rec = {k: [] for k in ("obs", "act", "ctrl", "qpos", "qvel")}
    obs = env.observe()
    for t in range(steps):
        noise = hidden.obs_noise
        rec["obs"].append(obs)
        rec["qpos"].append(env.qpos + rng.normal(0, noise, env.qpos.shape))
        rec["qvel"].append(env.qvel + rng.normal(0, noise, env.qvel.shape))
        rec["act"].append(actions[t])
        rec["ctrl"].append(env.controls_preview(actions[t]))
        obs = env.step(actions[t]).obs
    arrays = {k: np.stack(v, axis=1) for k, v in rec.items()}  # (episodes, steps, dim)
    obs_names = [o.name for o in task.observations]
    act_names = [a.name for a in task.actions]
    table = pa.concat_tables([
        logs.episode_table(e, task.ctrl_dt, obs_names, act_names, *(arrays[k][e] for k in ("obs", "act", "ctrl", "qpos", "qvel")),
                           policy_version="excitation", device_id=standin.robot_id(task.name))
        for e in range(cfg.episodes)
    ])
    with atomic_dir(out_dir) as tmp:
        logs.write(table, tmp / "part-000.parquet")
        files = [{"name": "part-000.parquet", "sha256": sha256_path(tmp / "part-000.parquet"), "rows": table.num_rows}]
        manifest = {
            "schema_version": logs.SCHEMA_VERSION,
            "task": cfg.task,
            "robot": standin.robot_id(task.name),
            "source": f"{standin.LABEL} rollouts (random excitation)",
            "episodes": cfg.episodes,
            "rows": table.num_rows,
            "time_range_s": [0.0, steps * task.ctrl_dt],
            "files": files,
        }
        manifest["digest"] = sha256_json(files)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return Dataset(path=out_dir, digest=manifest["digest"], task=cfg.task, source=manifest["source"],
                   episodes=cfg.episodes, rows=table.num_rows)
