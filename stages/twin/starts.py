"""The replays' start states fitted with the parameters (errors in variables).

A replay starts from a logged state, and the log's sensor noise on it moves the whole replay: least squares that takes
the start as exact treats that correlated error as the parameters'. Here each window's start (the robot's hinge and
slide joints' positions and velocities) is a parameter too, tied to its logged value as one more measurement: each
window adds √weight · (start − logged start) to its residuals, ``weight`` = 1 / ``Windows.start_noise``² (the start's
noise over the targets'). The starts are profiled out (variable projection): for candidate parameters, each window's
start takes the Gauss-Newton step that minimises its residuals, with the replay's Jacobian in its start held from the
point where the ``Profile`` was made. Windows are independent, so that Jacobian takes one replay per start coordinate
(all windows moved at once), and each step is a small system per window. Finite differences of the profiled
residuals in the parameters then give the projected Jacobian, so Levenberg-Marquardt and the bootstrap run unchanged
on them (``intervals``).

Why, measured on the per-joint reacher (5 min of logs, σ = 0.002, joint 0's friction 0.02 N m): fitted from the logged
starts over four seeds, joint 0's friction came to 0.028, 0.024, 0.000 and 0.005 N m, four times the spread its
Cramér–Rao bound allows, and from the noise-free starts to 0.0174 and 0.0157 N m (seeds 0 and 2). Refitting the starts
for a fixed fit and then the fit for those starts (alternating) kept the first fit's error: the starts absorb it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from stages.sim.params import PhysicalParams
from stages.twin.intervals import Optimum, Residuals
from stages.sim.task import Task
from stages.twin.episodes import SCALAR_JOINTS, limited_joints
from stages.twin.replay import Replayer, Windows

DELTA = 1e-5
"""Forward-difference step of the start coordinates (rad, rad/s, m, m/s)."""
LIMIT_MARGIN = 0.02
"""``off_limits`` keeps a window whose range-limited joints stay this fraction of their range from the limits."""


def off_limits(task: Task, win: Windows) -> Windows:
    """``win`` with each range-limited robot joint's residuals left out from the first step at which it comes within
    ``LIMIT_MARGIN`` of its range of a limit (``Windows.mask``; the other joints' stay). Why: against a limit the
    replay error is rough in friction (the limit and friction constraints solved together): on the per-joint reacher
    (seed 3, 46-step windows) joint 1's friction scanned from 0.03 to 0.04 N m dropped the profiled error 29%, and
    Levenberg-Marquardt stopped at 0.10 N m where 0.07 scored lower, and the truth, 0.06, lower than its estimate.
    Cutting every joint there instead (the reacher kept 42% of its steps) raised the Cramér–Rao bound of the free
    shoulder's friction from 5.2% to 16.5%: its information is in the windows' later steps."""
    adr, low, high = limited_joints(task)
    mask = np.ones((*win.target.shape[:2], len(task.replayed_qpos)))
    for q, lo, hi in zip(adr, low, high):
        margin = LIMIT_MARGIN * (hi - lo)
        near = (win.target[..., q] <= lo + margin) | (win.target[..., q] >= hi - margin)  # (W, T)
        near[(win.start[:, 1 + q] <= lo + margin) | (win.start[:, 1 + q] >= hi - margin)] = True
        mask[..., int(np.flatnonzero(task.replayed_qpos == q)[0])] = np.cumsum(near, axis=1) == 0
    return win.model_copy(update={"mask": mask})


def start_columns(replayer: Replayer) -> np.ndarray:
    """Columns of the full-physics state a start fit moves: the qpos, then the qvel, of the replayed hinge and slide
    joints (a free or ball joint's start stays as logged)."""
    m, replayed = replayer.task.model, set(replayer.joints.tolist())
    joints = [j for j in range(m.njnt) if int(m.jnt_type[j]) in SCALAR_JOINTS and int(m.jnt_qposadr[j]) in replayed]
    return np.array([1 + m.jnt_qposadr[j] for j in joints] + [1 + m.nq + m.jnt_dofadr[j] for j in joints], np.int64)


class Profile:
    """Residuals with the windows' starts profiled out, linearised in the start at ``params`` and the windows' starts,
    each start tied to ``logged`` (W, nstate; default: the windows' starts), or to ``logged`` (P, W, nstate), one set
    per problem: then candidate i replays problem i."""

    def __init__(self, replayer: Replayer, params: PhysicalParams, logged: np.ndarray | None = None) -> None:
        self.replayer, self.cols = replayer, start_columns(replayer)
        self.logged = replayer.win.start if logged is None else logged
        self.weight = 1.0 / replayer.win.start_noise**2
        k = len(self.cols)
        moved = np.repeat(replayer.win.start[None], k + 1, axis=0)
        moved[np.arange(1, k + 1), :, self.cols] += DELTA
        r = replayer.residuals([params] * (k + 1), moved)
        self.jac = np.moveaxis((r[1:] - r[:1]) / DELTA, 0, -1)  # (W, m, k)
        self.normal = np.einsum("wmi,wmj->wij", self.jac, self.jac) + self.weight * np.eye(k)

    def fitted(self, candidates: list[PhysicalParams]) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's profiled residuals (C, W, m + k) and fitted starts (C, W, nstate): from its logged starts,
        each window's Gauss-Newton step on its replay's residuals and its tie."""
        count = len(candidates)
        logged = self.logged[:count] if self.logged.ndim == 3 else np.repeat(self.logged[None], count, axis=0)
        start = logged.copy()
        r = self.replayer.residuals(candidates, start)
        step = -np.linalg.solve(self.normal, np.einsum("wmi,cwm->cwi", self.jac, r)[..., None])[..., 0]  # (C, W, k)
        start[..., self.cols] += step
        tie = np.sqrt(self.weight) * step
        return np.concatenate([r + np.einsum("wmk,cwk->cwm", self.jac, step), tie], axis=-1), start

    def residuals(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """Each candidate's profiled residuals (C, W, m + k): the replay's, then the starts' ties."""
        return self.fitted(candidates)[0]


def fit(replayer: Replayer, params_of: Callable[[np.ndarray], PhysicalParams], x: np.ndarray,
        polish: Callable[[Residuals, np.ndarray], Optimum]) -> tuple[Optimum, Replayer]:
    """Parameters and starts fitted together from ``x`` and the logged starts: ``polish`` (a least-squares fit from a
    point) of a ``Profile``'s residuals made at ``x``. Returns its optimum and a replayer of the windows from the
    optimum's starts. A second round (a profile made at the optimum and its starts, polished again) moved the per-joint
    reacher's frictions at most 0.0004 N m (0.7% of joint 1's; seeds 0, 3 and 9) for 4-10 s more."""
    profile = Profile(replayer, params_of(x))
    optimum = polish(lambda xs: profile.residuals([params_of(v) for v in xs]), x)
    start = profile.fitted([params_of(optimum.x)])[1][0]
    return optimum, Replayer(replayer.task, replayer.win.model_copy(update={"start": start}), len(replayer.datas))
