"""Calibrate: fit the twin's physical parameters to logged trajectories.

Short windows of the logs are replayed from their logged start states with the logged
controls held per control step; CMA-ES (the ``cmaes`` package) minimises the RMS error
between replayed and logged joint positions over log-scales of the parameters. A whole
CMA-ES generation (population × windows) replays in one ``mujoco.rollout`` call.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mujoco
import numpy as np
from cmaes import CMA
from mujoco import rollout
from pydantic import BaseModel, ConfigDict, Field

from stages import logs
from stages.artifacts import Dataset, TwinSpec, atomic_dir, sha256_json
from stages.sim.env import STATE_SPEC
from stages.sim.params import PhysicalParams, apply_params
from stages.sim.registry import load
from stages.sim.task import Task

FITTED = ("damping", "actuator_gain", "mass")


class CalibrateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    window: int = Field(20, ge=2, description="Replay window length in control steps.")
    max_windows: int = Field(192, ge=1, description="Windows sampled from the dataset.")
    generations: int = Field(40, ge=1, description="CMA-ES generations.")
    population: int = Field(8, ge=4)
    seed: int = 0
    nthread: int = 2


class Windows(BaseModel):
    """Replay windows: start states (W, nstate), controls (W, T*decimation, nu), targets (W, T, nq)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    start: np.ndarray
    control: np.ndarray
    target: np.ndarray


def windows(task: Task, dataset: Dataset, cfg: CalibrateConfig) -> Windows:
    """Cut the dataset into replay windows (sampled without replacement, seeded)."""
    manifest = json.loads((dataset.path / "manifest.json").read_text())
    table = logs.read(dataset.path / manifest["files"][0]["name"])
    qpos, qvel, ctrl = (logs.columns(table, p) for p in ("qpos", "qvel", "ctrl"))
    episode = table.column("episode").to_numpy()
    starts = [i for e in np.unique(episode) for i in np.flatnonzero(episode == e)[: -cfg.window : cfg.window]]
    rng = np.random.default_rng(cfg.seed)
    starts = np.sort(rng.choice(starts, size=min(cfg.max_windows, len(starts)), replace=False))
    nstate = mujoco.mj_stateSize(task.model, STATE_SPEC)
    start = np.zeros((len(starts), nstate))
    start[:, 1 : 1 + task.model.nq] = qpos[starts]
    start[:, 1 + task.model.nq : 1 + task.model.nq + task.model.nv] = qvel[starts]
    steps = starts[:, None] + np.arange(cfg.window)
    control = np.repeat(ctrl[steps], task.decimation, axis=1).astype(np.float64)
    return Windows(start=start, control=control, target=qpos[steps + 1])


class Replayer:
    """Replays all windows for a batch of candidate parameter sets in one rollout call."""

    def __init__(self, task: Task, win: Windows, nthread: int) -> None:
        self.task, self.win = task, win
        self.pool = rollout.Rollout(nthread=nthread)
        self.datas = [mujoco.MjData(task.model) for _ in range(nthread)]

    def errors(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """RMS joint-position error of each candidate over every window."""
        models = [apply_params(copy.deepcopy(self.task.model), self.task.model, p, self.task.mass_mask) for p in candidates]
        n = len(self.win.start)
        per_roll = [m for m in models for _ in range(n)]
        nstep = self.win.control.shape[1]
        state = np.empty((len(per_roll), nstep, self.win.start.shape[1]))
        sensors = np.empty((len(per_roll), nstep, self.task.model.nsensordata))
        self.pool.rollout(
            per_roll, self.datas, np.tile(self.win.start, (len(models), 1)), np.tile(self.win.control, (len(models), 1, 1)),
            nstep=nstep, skip_checks=True, state=state, sensordata=sensors,
        )
        nq = self.task.model.nq
        replayed = state[:, self.task.decimation - 1 :: self.task.decimation, 1 : 1 + nq]
        err = (replayed - np.tile(self.win.target, (len(models), 1, 1))) ** 2
        return np.sqrt(err.reshape(len(models), -1).mean(axis=1))


def _params(prior: PhysicalParams, x: np.ndarray) -> PhysicalParams:
    return prior.model_copy(update={name: float(np.exp(v)) for name, v in zip(FITTED, x)})


def calibrate(cfg: CalibrateConfig, dataset: Dataset, out_dir: Path) -> TwinSpec:
    """Fit damping, actuator gain and mass scale to ``dataset``; write ``out_dir/twin.json``."""
    task = load(dataset.task)
    prior = task.nominal_params()
    replayer = Replayer(task, windows(task, dataset, cfg), cfg.nthread)
    optimizer = CMA(mean=np.zeros(len(FITTED)), sigma=0.3, bounds=np.log([[0.2, 5.0]] * len(FITTED)),
                    population_size=cfg.population, seed=cfg.seed)
    for _ in range(cfg.generations):
        xs = [optimizer.ask() for _ in range(optimizer.population_size)]
        errs = replayer.errors([_params(prior, x) for x in xs])
        optimizer.tell(list(zip(xs, errs.tolist())))
    fitted = _params(prior, optimizer.mean)
    before, after = replayer.errors([prior, fitted]).tolist()
    # relative 1-sigma of the final search distribution, per parameter (log-space std ≈ relative std)
    sigma = optimizer._sigma * np.sqrt(np.diag(optimizer._C))
    uncertainty = {name: float(s) for name, s in zip(FITTED, sigma)}
    spec = {
        "task": dataset.task,
        "params": fitted.model_dump(),
        "prior": prior.model_dump(),
        "uncertainty": uncertainty,
        "dataset_digest": dataset.digest,
        "replay_error_before": before,
        "replay_error_after": after,
        "windows": len(replayer.win.start),
        "window_steps": cfg.window,
    }
    digest = sha256_json(spec)
    with atomic_dir(out_dir) as tmp:
        (tmp / "twin.json").write_text(json.dumps({**spec, "digest": digest}, indent=2))
    return TwinSpec(path=out_dir / "twin.json", digest=digest, task=dataset.task, params=fitted, uncertainty=uncertainty,
                    dataset_digest=dataset.digest, replay_error_before=before, replay_error_after=after)
