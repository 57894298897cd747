"""Calibration on arm6's per-joint stand-in (issue 33): how many of its 24 per-joint values (damping, gain and
friction per joint, mass per link) the twin's 95% intervals hold, and what was fitted.

Before the per-joint friction start was raced (``stages.twin.search.fit_joints``): 8 of 24 held, friction 1.5–12 N m
for truths of 0.34–0.67 N m, no ``mass_by_body`` intervals. After: 24 of 24, 369 s on a loaded 2-core machine.
Also prints the share of physics steps each servo spends at its force limit under the excitation (``--scale``: its
std before the ±1 clip; default arm6's ``excitation_scale``), where the servo's gain does not act.
Run: PYTHONPATH=. .venv/bin/python benchmarks/calibrate_arm6_per_joint.py [--episodes 24] [--windows 96]
[--generations 70] [--scale 0.5]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import mujoco
import numpy as np

from stages import logs, standin
from stages.collect.rollouts import record
from stages.collect.store import DatasetStore
from stages.sim.params import PhysicalParams, apply_params
from stages.sim.registry import load
from stages.sim.task import Task
from stages.twin.calibrate import CalibrateConfig, calibrate

SCALES = (("damping_by_joint", "damping"), ("gain_by_actuator", "actuator_gain"), ("friction_by_joint", None),
          ("mass_by_body", "mass"))


def saturation(task: Task, params: PhysicalParams, log: Path) -> np.ndarray:
    """Share of physics steps each actuator's force sits at its limit, re-simulating the log's commands (after the
    action latency) on ``params`` from each episode's first logged position, at rest."""
    model = apply_params(copy.deepcopy(task.model), task.model, params, task.mass_mask)
    data, limit = mujoco.MjData(model), model.actuator_forcerange[:, 1]
    table = logs.read(log)
    episode, ctrl, qpos = table.column("episode").to_numpy(), logs.columns(table, "ctrl"), logs.columns(table, "qpos")
    at_limit, steps = np.zeros(model.nu), 0
    for e in np.unique(episode):
        rows = episode == e
        mujoco.mj_resetData(model, data)
        data.qpos[:] = qpos[rows][0]
        applied = np.vstack([np.repeat(task.action_default[None], params.latency_steps, 0), ctrl[rows]])
        for c in applied[: rows.sum()]:
            data.ctrl[:] = c
            for _ in range(task.decimation):
                mujoco.mj_step(model, data)
                at_limit += np.abs(data.actuator_force) >= limit - 1e-9
                steps += 1
    return at_limit / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=24)
    ap.add_argument("--windows", type=int, default=96)
    ap.add_argument("--generations", type=int, default=70)
    ap.add_argument("--scale", type=float, default=None, help="excitation std (default: arm6's excitation_scale)")
    args = ap.parse_args()
    task, truth = load("arm6"), standin.hidden_params("arm6", "per-joint")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        log = record(task, truth, args.episodes, 0, tmp / "log.parquet", standin.robot_id("arm6", "per-joint"),
                     amplitude=args.scale)
        print(f"scale {task.excitation_scale if args.scale is None else args.scale}: at the force limit "
              + ", ".join(f"{a.name} {s:.0%}" for a, s in zip(task.actions, saturation(task, truth, log))))
        ds = DatasetStore(tmp / "ds", task, "arm6").ingest([log], "bench").dataset
        start = time.time()
        twin = calibrate(CalibrateConfig(max_windows=args.windows, generations=args.generations, search_generations=6,
                                         max_latency=1, body_masses=True), ds, tmp / "twin")
        seconds = time.time() - start
    p, held = twin.params, 0
    print(f"global: {({k: round(getattr(p, k), 3) for k in ('damping', 'actuator_gain', 'mass', 'friction')})}, "
          f"unidentified {list(twin.unidentified)}")
    for field, scale in SCALES:
        for name, true in getattr(truth, field).items():
            s_fit, s_true = (getattr(p, scale), getattr(truth, scale)) if scale else (1.0, 1.0)
            lo, hi = (s_fit * v for v in twin.intervals.get(f"{field}.{name}", (float("nan"),) * 2))
            ok = lo <= s_true * true <= hi
            held += ok
            print(f"{'held' if ok else 'MISS'} {field}.{name}: truth {s_true * true:.4f} "
                  f"fit {s_fit * getattr(p, field).get(name, float('nan')):.4f} [{lo:.4f}, {hi:.4f}]")
    print(f"{held} of {sum(len(getattr(truth, f)) for f, _ in SCALES)} held; replay error "
          f"{twin.replay_error_after:.5f} (misfit {twin.misfit.ratio:.2f}× the noise floor); calibration {seconds:.0f} s")


if __name__ == "__main__":
    main()
