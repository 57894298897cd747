"""Replay windows cut from a dataset, and their replay under candidate parameters in one ``mujoco.rollout`` call."""

from __future__ import annotations

import copy
from typing import Optional

import mujoco
import numpy as np
import pyarrow as pa
from mujoco import rollout
from pydantic import BaseModel, ConfigDict
from scipy.signal import savgol_coeffs, savgol_filter

from stages import logs
from stages.artifacts import Dataset
from stages.collect.store import dataset_files
from stages.sim.env import STATE_SPEC
from stages.sim.params import PhysicalParams, apply_params
from stages.sim.task import Task
from stages.twin.calibration_config import CalibrateConfig


class Windows(BaseModel):
    """Replay windows: start states (W, nstate), controls per latency (L+1, W, T*decimation, nu), targets (W, T, nq),
    the episode each was cut from (W,), numbered in dataset order, and the window the start states were smoothed
    over (``smoothed``; 1: raw). With sensors in the residual (``CalibrateConfig.sensors``), per sensor component k:
    the logged readings (W, T, k), where each lies in ``sensordata``, its weight, and its sensor's name."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    start: np.ndarray
    control: np.ndarray
    target: np.ndarray
    episode: np.ndarray
    smoothing: int = 1
    sensor_target: np.ndarray = np.zeros((0, 0, 0))
    sensor_index: np.ndarray = np.zeros(0, np.int64)
    sensor_weight: np.ndarray = np.zeros(0)
    sensor_names: tuple[str, ...] = ()
    mask: Optional[np.ndarray] = None
    """(W, T, replayed joints) weight of each step's joint residuals (0: left out), or None: every one counts."""

    @property
    def start_noise(self) -> float:
        """The std of the start states' noise as a fraction of the logs' (``smoothing_noise``)."""
        return smoothing_noise(self.smoothing)


def thinned(win: Windows, count: int) -> Windows:
    """Every k-th window of ``win``, k the largest that leaves at least ``count`` (all of them when there are fewer
    than 2 × ``count``)."""
    k = max(1, len(win.start) // count)
    return win.model_copy(update={"start": win.start[::k], "control": win.control[:, ::k], "target": win.target[::k],
                                  "episode": win.episode[::k], "sensor_target": win.sensor_target[::k]})


SMOOTHING_ORDER = 2


def smoothed(values: np.ndarray, boundaries: np.ndarray, window: int) -> np.ndarray:
    """``values`` (steps, k) through a quadratic Savitzky-Golay filter of ``window`` samples, episode by episode (an
    episode shorter than the window is left raw).

    Why: a replay starts from a logged, noisy state, and least squares is biased by noise on its inputs. On the
    contact-rich quadruped (σ = 0.002) a 2 mm error in body height changes the foot contacts, and the raw starts moved
    the fit's gain +2.5%, payload +6.4% and friction 4.7× from the truth, which noise-free logs recover within 0.8%;
    starts smoothed over 5 samples bring them to +0.4%, +0.1% and 1.4×, inside their intervals."""
    if window == 1:
        return values
    out = values.copy()
    for b, e in zip(boundaries[:-1], boundaries[1:]):
        if e - b >= window:
            out[b:e] = savgol_filter(values[b:e], window, SMOOTHING_ORDER, axis=0)
    return out


def smoothing_noise(window: int) -> float:
    """The std of white noise after the filter, as a fraction of before: the root sum of squares of its
    centre coefficients."""
    return 1.0 if window == 1 else float(np.sqrt((savgol_coeffs(window, SMOOTHING_ORDER) ** 2).sum()))


class SensorColumns(BaseModel):
    """The sensors of the residual as logged: readings (rows, k) from their observation terms' columns, and per
    component where it lies in ``sensordata``, its weight, its sensor and its latency in control steps."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    values: np.ndarray
    index: np.ndarray
    weight: np.ndarray
    names: tuple[str, ...]
    delay: np.ndarray


def sensor_columns(task: Task, table: pa.Table, weights: dict[str, float]) -> SensorColumns:
    """The logged readings of the sensors in ``weights`` (``Term.sensor``); a sensor no observation term reads
    verbatim is refused naming it."""
    unread = task.unread_sensors(weights)
    if unread:
        raise ValueError(f"calibrate: sensors: {unread[0]}")
    known = task.sensor_terms
    terms = [(name, i, k) for name in weights for k, i in enumerate(known[name])]
    values = np.stack([table.column(f"obs.{task.observations[i].name}").to_numpy().astype(np.float64)
                       for _, i, _ in terms], axis=1) if terms else np.zeros((table.num_rows, 0))
    return SensorColumns(values=values, index=np.array([task.sensor_slices[n].start + k for n, _, k in terms], np.int64),
                         weight=np.array([weights[n] for n, _, _ in terms]), names=tuple(n for n, _, _ in terms),
                         delay=np.array([task.observations[i].delay_steps for _, i, _ in terms], np.int64))


def windows(task: Task, dataset: Dataset, cfg: CalibrateConfig) -> Windows:
    """Cut every file of the dataset into replay windows (sampled without replacement, seeded), starting from the logged
    states smoothed over ``cfg.start_smoothing`` (default: the task's) samples (``smoothed``); the targets stay as logged.

    A log's row t holds the joint state at control tick t and the observation the policy got there: sensor readings
    of the period before it, ``delay_steps`` periods older still. So the state after a window's step j is row s+j+1,
    and the readings of that step are row s+j+1+delay."""
    table = pa.concat_tables([logs.read(p) for p in dataset_files(dataset)])
    qpos, qvel, ctrl = (logs.columns(table, p) for p in ("qpos", "qvel", "ctrl"))
    sensors = sensor_columns(task, table, cfg.sensors)
    tail = int(sensors.delay.max(initial=0))
    episode = table.column("episode").to_numpy()
    boundaries = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1], True])  # files concatenate episode-wise
    starts = [s for b, e in zip(boundaries[:-1], boundaries[1:])
              for s in range(b + cfg.max_latency, e - cfg.window - tail, cfg.window)]
    if not starts:
        raise ValueError(f"dataset {dataset.path}: no episode is longer than window + max_latency "
                         f"({cfg.window} + {cfg.max_latency} steps)")
    rng = np.random.default_rng(cfg.seed)
    starts = np.sort(rng.choice(starts, size=min(cfg.max_windows, len(starts)), replace=False))
    m = task.model
    start = np.zeros((len(starts), mujoco.mj_stateSize(m, STATE_SPEC)))
    smoothing = cfg.start_smoothing or task.start_smoothing
    start[:, 1 : 1 + m.nq] = smoothed(qpos, boundaries, smoothing)[starts]
    start[:, 1 + m.nq : 1 + m.nq + m.nv] = smoothed(qvel, boundaries, smoothing)[starts]
    steps = starts[:, None] + np.arange(cfg.window)
    control = np.stack([np.repeat(ctrl[steps - lag], task.decimation, axis=1) for lag in range(cfg.max_latency + 1)])
    readings = sensors.values[steps[..., None] + 1 + sensors.delay, np.arange(len(sensors.index))]  # (W, T, k)
    return Windows(start=start, control=control.astype(np.float64), target=qpos[steps + 1],
                   episode=np.searchsorted(boundaries, starts, side="right") - 1, smoothing=smoothing,
                   sensor_target=readings, sensor_index=sensors.index, sensor_weight=sensors.weight,
                   sensor_names=sensors.names)


def noise_estimate(replayer: Replayer, fitted: PhysicalParams) -> float:
    """Sensor noise std from the one-step replay residual (target noise σ², start noise (gσ)² with g the smoothing's
    ``Windows.start_noise``: var ≈ (1 + g²)σ²)."""
    first = (replayer.replay([fitted])[0, :, 0] - replayer.win.target[:, 0])[:, replayer.joints]
    return float(np.sqrt((first**2).mean() / (1 + replayer.win.start_noise**2)))


class Replayer:
    """Replays all windows for a batch of candidate parameter sets in one rollout call."""

    def __init__(self, task: Task, win: Windows, nthread: int) -> None:
        self.task, self.win = task, win
        self.pool = rollout.Rollout(nthread=nthread)
        self.datas = [mujoco.MjData(task.model) for _ in range(nthread)]
        self.joints = task.replayed_qpos

    @property
    def width(self) -> int:
        """Residuals per window and step: the replayed joints, then the sensor components."""
        return len(self.joints) + len(self.win.sensor_index)

    def rollout(self, candidates: list[PhysicalParams], start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Replayed joint positions (C, W, T, nq) and sensor readings at the control ticks (C, W, T, nsensordata) of
        each candidate (uses its ``latency_steps``), from the windows' start states or ``start``: (W, nstate) for
        every candidate, or (C, W, nstate), one set per candidate."""
        task, n = self.task, len(self.win.start)
        start = self.win.start if start is None else start
        models = [apply_params(copy.deepcopy(task.model), task.model, p, task.mass_mask) for p in candidates]
        control = np.concatenate([self.win.control[p.latency_steps] for p in candidates])
        nstep = control.shape[1]
        state = np.empty((len(control), nstep, self.win.start.shape[1]))
        sensors = np.empty((len(control), nstep, task.model.nsensordata))
        initial = np.tile(start, (len(models), 1)) if start.ndim == 2 else start.reshape(-1, start.shape[-1])
        self.pool.rollout([m for m in models for _ in range(n)], self.datas, initial, control, nstep=nstep,
                          skip_checks=True, state=state, sensordata=sensors)
        tick = slice(task.decimation - 1, None, task.decimation)
        qpos, sensors = state[:, tick, 1 : 1 + task.model.nq], sensors[:, tick]
        return (qpos.reshape(len(models), n, *qpos.shape[1:]), sensors.reshape(len(models), n, *sensors.shape[1:]))

    def replay(self, candidates: list[PhysicalParams], start: np.ndarray | None = None) -> np.ndarray:
        """Replayed joint positions of each candidate, from the windows' start states or ``start``: (C, W, T, nq)."""
        return self.rollout(candidates, start)[0]

    def residuals(self, candidates: list[PhysicalParams], start: np.ndarray | None = None) -> np.ndarray:
        """Replayed (from the windows' start states or ``start``, as in ``rollout``) minus logged positions of the
        task's replayed joints, then the weighted replayed minus logged readings of the residual's sensors, per
        candidate and window: (C, W, T·width)."""
        qpos, sensors = self.rollout(candidates, start)
        diff = (qpos - self.win.target)[..., self.joints]
        if self.win.mask is not None:
            diff = diff * self.win.mask
        if len(self.win.sensor_index):
            weighted = (sensors[..., self.win.sensor_index] - self.win.sensor_target) * self.win.sensor_weight
            diff = np.concatenate([diff, weighted], axis=-1)
        return diff.reshape(len(candidates), len(self.win.start), -1)

    def errors(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """RMS of each candidate's residuals over every window (the fit's objective)."""
        return np.sqrt((self.residuals(candidates) ** 2).reshape(len(candidates), -1).mean(axis=1))

    def joint_errors(self, candidates: list[PhysicalParams]) -> np.ndarray:
        """RMS error of each candidate's replayed joint positions over every window (the twin's replay error, rad)."""
        diff = (self.replay(candidates) - self.win.target)[..., self.joints]
        return np.sqrt((diff**2).reshape(len(candidates), -1).mean(axis=1))

    def sensor_errors(self, candidate: PhysicalParams) -> dict[str, float]:
        """Per sensor of the residual: RMS of replayed minus logged readings, in the sensor's unit (unweighted)."""
        sensors = self.rollout([candidate])[1][0][..., self.win.sensor_index] - self.win.sensor_target
        names = np.array(self.win.sensor_names)
        return {n: float(np.sqrt((sensors[..., names == n] ** 2).mean())) for n in dict.fromkeys(self.win.sensor_names)}
