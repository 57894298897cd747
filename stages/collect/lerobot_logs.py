"""LeRobot v3 datasets to and from the log format: demonstrations and robot logs in, dataset versions out.

In, by a mapping (YAML; every key optional, the defaults read what :func:`to_lerobot` writes)::

    qpos: {feature: observation.state, rename: {shoulder_pan.pos: shoulder_pan}}  # elements -> MJCF joints
    qvel: {feature: observation.velocity}   # or null: the central difference of qpos at the dataset's fps
    ctrl: {feature: action}                 # elements -> actuators (or the joints they drive)
    policy_version: demonstration
    device_id: null                         # default lerobot:<folder name>

Elements are matched by name (the feature's ``names`` in ``info.json``), never by position; a name the task
does not have, or a joint or actuator no element names, is an error. The dataset's fps must be the task's
control rate. Each episode becomes one log file, so a bad episode is quarantined alone by the store's checks.

Out: ``observation.state`` (the task's observation terms, float32), ``action`` (actuator controls, float32),
``observation.qpos`` / ``observation.qvel`` (the measured joint state, float64, element names from
:func:`qpos_names` / :func:`qvel_names`), one task (the task's name), fps the control rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mujoco
import numpy as np
import pyarrow as pa
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stages import logs
from stages.artifacts import Dataset
from stages.collect import lerobot_layout
from stages.collect.bag_logs import observations
from stages.collect.bag_reader import NameMap, actuator_names
from stages.collect.lerobot_layout import Feature, LeRobotEpisodes, LeRobotFormatError
from stages.collect.store import dataset_files
from stages.sim.task import Task

_FREE = (".x", ".y", ".z", ".qw", ".qx", ".qy", ".qz")
_BALL = (".qw", ".qx", ".qy", ".qz")


class FeatureMap(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    feature: str = Field(min_length=1, description="The LeRobot feature (a vector in info.json).")
    rename: dict[str, str] = Field(default_factory=dict, description="Element name -> MJCF joint or actuator name.")


class LeRobotMapping(BaseModel):
    """Which LeRobot features are the robot's joint state and its actuator controls."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    qpos: FeatureMap = FeatureMap(feature="observation.qpos")
    qvel: Optional[FeatureMap] = FeatureMap(feature="observation.qvel")
    ctrl: FeatureMap = FeatureMap(feature="action")
    policy_version: str = Field("demonstration", min_length=1)
    device_id: Optional[str] = None


def load_mapping(path: Path | None) -> LeRobotMapping:
    """The mapping in ``path`` (the defaults without one); ValueError naming the file and the key."""
    if path is None:
        return LeRobotMapping()
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return LeRobotMapping.model_validate(data)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: unreadable mapping ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"{path}: {'.'.join(map(str, err['loc'])) or '(top level)'}: {err['msg']} "
                         f"(got {err.get('input')!r})") from None


def qpos_names(model: mujoco.MjModel) -> list[str]:
    """One name per qpos: the joint's name, with ``.x … .qz`` suffixes for free and ball joints."""
    out = []
    for j in range(model.njnt):
        name, kind = model.joint(j).name, model.jnt_type[j]
        out += ([name + s for s in _FREE] if kind == mujoco.mjtJoint.mjJNT_FREE
                else [name + s for s in _BALL] if kind == mujoco.mjtJoint.mjJNT_BALL else [name])
    return out


def qvel_names(model: mujoco.MjModel) -> list[str]:
    """One name per dof: the joint's name, with ``.vx … .wz`` suffixes for free and ``.wx … .wz`` for ball joints."""
    out = []
    for j in range(model.njnt):
        name, kind = model.joint(j).name, model.jnt_type[j]
        out += ([name + s for s in (".vx", ".vy", ".vz", ".wx", ".wy", ".wz")] if kind == mujoco.mjtJoint.mjJNT_FREE
                else [name + s for s in (".wx", ".wy", ".wz")] if kind == mujoco.mjtJoint.mjJNT_BALL else [name])
    return out


def _columns(root: Path, data: LeRobotEpisodes, fmap: FeatureMap, known: dict[str, int], what: str) -> np.ndarray:
    """The feature's values as (frames, task width), its elements put in the task's order by name."""
    order = NameMap(known, fmap.rename, what).order(data.features[fmap.feature].names)
    if isinstance(order, str):
        raise LeRobotFormatError(f"{root}/meta/info.json: features.{fmap.feature}: {order}")
    return data.values[fmap.feature][:, order]


def to_logs(root: Path, mapping: LeRobotMapping, task: Task, out_dir: Path) -> list[Path]:
    """Each episode of the LeRobot dataset under ``root`` as one log file in ``out_dir``, in episode order."""
    wanted = [f.feature for f in (mapping.qpos, mapping.qvel, mapping.ctrl) if f is not None]
    data = lerobot_layout.read(root, list(dict.fromkeys(wanted)))
    if abs(data.fps * task.ctrl_dt - 1) > 1e-6:
        raise LeRobotFormatError(f"{root}/meta/info.json: fps {data.fps:g} is not the control rate of task "
                                 f"{task.name!r} ({1 / task.ctrl_dt:g} Hz)")
    m = task.model
    qpos = _columns(root, data, mapping.qpos, {n: i for i, n in enumerate(qpos_names(m))}, "joint position")
    qvel = (_columns(root, data, mapping.qvel, {n: i for i, n in enumerate(qvel_names(m))}, "joint velocity")
            if mapping.qvel else None)
    ctrl = _columns(root, data, mapping.ctrl, actuator_names(task), "actuator")
    device_id = mapping.device_id or f"lerobot:{root.resolve().name}"
    paths = []
    for episode in np.unique(data.episode_index):
        at = np.flatnonzero(data.episode_index == episode)
        q = qpos[at]
        if qvel is not None:
            v = qvel[at]
        elif m.nq != m.nv:
            raise LeRobotFormatError(f"{root}: task {task.name!r} has free or ball joints: map qvel to a feature")
        else:
            v = np.gradient(q, task.ctrl_dt, axis=0) if len(at) > 1 else np.zeros_like(q)
        act = np.clip((ctrl[at] - task.action_default) / task.action_scale, -1, 1)
        table = logs.episode_table(int(episode), task.ctrl_dt, [o.name for o in task.observations],
                                   [a.name for a in task.actions], observations(task, q, v, act), act, ctrl[at], q, v,
                                   np.zeros(len(at)), mapping.policy_version, device_id)
        table = table.set_column(table.column_names.index("time"), "time",
                                 pa.array(data.timestamp[at].astype(np.float64)))
        path = out_dir / f"{root.resolve().name}-episode{int(episode):06d}.parquet"
        logs.write(table, path)
        paths.append(path)
    return paths


def to_lerobot(dataset: Dataset, task: Task, root: Path) -> LeRobotEpisodes:
    """Write a dataset version as a LeRobot v3.0 dataset under ``root``; episodes numbered in manifest order."""
    m = task.model
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("state", "action", "qpos", "qvel", "episode")}
    episodes = 0
    for path in dataset_files(dataset):
        table = logs.read(path)
        episode = table.column("episode").to_numpy()
        _, renumbered = np.unique(episode, return_inverse=True)
        parts["episode"].append(renumbered + episodes)
        episodes += int(renumbered.max()) + 1 if len(renumbered) else 0
        parts["state"].append(np.stack([table.column(f"obs.{o.name}").to_numpy() for o in task.observations], 1))
        for key, prefix in (("action", "ctrl"), ("qpos", "qpos"), ("qvel", "qvel")):
            parts[key].append(logs.columns(table, prefix))
    joined = {k: np.concatenate(v) for k, v in parts.items()}
    starts = np.r_[0, np.flatnonzero(np.diff(joined["episode"])) + 1]
    frame = np.arange(len(joined["episode"])) - np.repeat(starts, np.diff(np.r_[starts, len(joined["episode"])]))
    features = {"observation.state": Feature("observation.state", "float32", tuple(o.name for o in task.observations)),
                "action": Feature("action", "float32", tuple(m.actuator(a).name for a in range(m.nu))),
                "observation.qpos": Feature("observation.qpos", "float64", tuple(qpos_names(m))),
                "observation.qvel": Feature("observation.qvel", "float64", tuple(qvel_names(m)))}
    data = LeRobotEpisodes(fps=1 / task.ctrl_dt, features=features, episode_index=joined["episode"],
                           timestamp=frame * task.ctrl_dt, robot_type=task.name,  # seconds into the episode
                           values={"observation.state": joined["state"], "action": joined["action"],
                                   "observation.qpos": joined["qpos"], "observation.qvel": joined["qvel"]})
    lerobot_layout.write(root, data, task.name)
    return data
