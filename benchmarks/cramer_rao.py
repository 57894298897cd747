"""The Cramér–Rao bound of a stand-in's per-joint parameters on replay windows: the smallest standard deviation an
unbiased estimator can reach from those logs, σ²(JᵀJ)⁻¹ with J the replay residuals' Jacobian at the truth (central
differences) and σ the residuals' RMS there. The windows' start states are taken as exact, so the bound is
optimistic: a fit that also carries start-state noise can only do worse. ``calibrate_reacher.py --profile
per-joint`` prints it beside the twin's intervals, for the calibration's windows and for every window of the log."""

from __future__ import annotations

import numpy as np

from stages.sim.params import PhysicalParams
from stages.twin.replay import Replayer

PER_JOINT = ("damping_by_joint", "gain_by_actuator", "friction_by_joint")


def _moved(truth: PhysicalParams, field: str, joint: str, step: float) -> PhysicalParams:
    values = dict(getattr(truth, field))
    values[joint] += step
    return truth.model_copy(update={field: values})


def bound(replayer: Replayer, truth: PhysicalParams) -> dict[str, float]:
    """The bound's standard deviation of each per-joint parameter of ``truth``, by ``field.joint``."""
    names = [(f, j) for f in PER_JOINT for j in getattr(truth, f)]
    columns = []
    for field, joint in names:
        step = 1e-3 * max(abs(getattr(truth, field)[joint]), 1.0)
        plus, minus = replayer.residuals([_moved(truth, field, joint, step), _moved(truth, field, joint, -step)])
        columns.append(((plus - minus) / (2 * step)).ravel())
    jac = np.stack(columns, axis=1)
    sigma2 = float(np.mean(replayer.residuals([truth])[0] ** 2))
    sd = np.sqrt(np.diag(np.linalg.inv(jac.T @ jac)) * sigma2)
    return {f"{f}.{j}": float(s) for (f, j), s in zip(names, sd)}
