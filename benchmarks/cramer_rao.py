"""The Cramér–Rao bound of a stand-in's per-joint parameters on replay windows: the smallest standard deviation an
unbiased estimator can reach from those logs, σ²(JᵀJ)⁻¹ with J the replay residuals' Jacobian at the truth (central
differences) and σ the residuals' RMS there. The windows' start states are taken as exact, so the bound is
optimistic: a fit that also carries start-state noise can only do worse. ``calibrate_reacher.py --profile
per-joint`` prints it beside the twin's intervals, for the calibration's windows and for every window of the log, and,
with ``--fit-starts``, the bound when the starts are fitted too, on the per-joint pass's windows.

Measured (5 min of logs, joint 0's friction 0.02 N m, % of truth): starts exact, 11.2% on all 600 20-step windows; starts
fitted, 11.3% on 20-step windows, 9.1% on 300 of 30 steps and 4.5% on 300 of 46 steps (a replay's drift from a
constant friction torque grows as t², the start's nuisance as t)."""

from __future__ import annotations

import numpy as np

from stages.sim.params import PhysicalParams
from stages.twin.replay import Replayer
from stages.twin.starts import Profile

PER_JOINT = ("damping_by_joint", "gain_by_actuator", "friction_by_joint")


def _moved(truth: PhysicalParams, field: str, joint: str, step: float) -> PhysicalParams:
    values = dict(getattr(truth, field))
    values[joint] += step
    return truth.model_copy(update={field: values})


def bound(replayer: Replayer, truth: PhysicalParams, fit_starts: bool = False) -> dict[str, float]:
    """The bound's standard deviation of each per-joint parameter of ``truth``, by ``field.joint``. With ``fit_starts``
    the windows' starts are unknowns too, each tied to its logged value (``stages.twin.starts``): their information is
    projected out per window (the Schur complement) and σ is the sensor noise ``truth.obs_noise``."""
    names = [(f, j) for f in PER_JOINT for j in getattr(truth, f)]
    columns = []
    for field, joint in names:
        step = 1e-3 * max(abs(getattr(truth, field)[joint]), 1.0)
        plus, minus = replayer.residuals([_moved(truth, field, joint, step), _moved(truth, field, joint, -step)])
        columns.append((plus - minus) / (2 * step))
    jac = np.stack(columns, axis=-1)  # (W, m, p)
    info = np.einsum("wmi,wmj->ij", jac, jac)
    if fit_starts:
        profile = Profile(replayer, truth)
        cross = np.einsum("wmk,wmi->wki", profile.jac, jac)
        info = info - np.einsum("wki,wkj->ij", cross, np.linalg.solve(profile.normal, cross))
        sigma2 = truth.obs_noise**2
    else:
        sigma2 = float(np.mean(replayer.residuals([truth])[0] ** 2))
    sd = np.sqrt(np.diag(np.linalg.inv(info)) * sigma2)
    return {f"{f}.{j}": float(s) for (f, j), s in zip(names, sd)}
