"""A calibrated twin's files: ``twin.xml`` (the identified MJCF), the replay plot, and ``twin.json`` read back."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import mujoco
import numpy as np

from stages.artifacts import Misfit, TwinSpec
from stages.sim.params import PhysicalParams, apply_params
from stages.sim.registry import load
from stages.sim.task import Task
from stages.twin.replay import Replayer


def write_mjcf(task: Task, params: PhysicalParams, path: Path) -> None:
    """The task's MJCF with ``params`` written into it (damping, armature, friction per joint, gain per actuator,
    mass and inertia of the scaled bodies), as ``MjModel.from_xml_path`` loads it back.

    ``MjSpec`` sets the values; its writer prints 6 significant digits, so the changed attributes are then
    rewritten at full precision (the XML lists joints, bodies and actuators in model order)."""
    spec = task.spec()
    model = apply_params(spec.compile(), task.model, params, task.mass_mask)
    # set in the spec too, so that the writer emits them (a shortcut such as <motor> becomes <general gainprm=…>)
    for joint in spec.joints:
        dof = model.jnt_dofadr[joint.id]
        joint.damping[0], joint.armature = model.dof_damping[dof], model.dof_armature[dof]
        joint.frictionloss = model.dof_frictionloss[dof]
    for actuator in spec.actuators:
        actuator.gainprm[:] = model.actuator_gainprm[actuator.id]
        actuator.biasprm[:] = model.actuator_biasprm[actuator.id]
    scaled = model.body_mass != task.model.body_mass
    if scaled.any():
        spec.compiler.inertiafromgeom = mujoco.mjtInertiaFromGeom.mjINERTIAFROMGEOM_AUTO
        for body in spec.bodies:
            if scaled[body.id]:
                body.explicitinertial, body.mass, body.inertia = True, model.body_mass[body.id], model.body_inertia[body.id]
                body.ipos, body.iquat = model.body_ipos[body.id], model.body_iquat[body.id]
    root = ElementTree.fromstring(spec.to_xml())
    exact = lambda values: " ".join(repr(float(v)) for v in np.atleast_1d(values))  # noqa: E731
    world = root.find("worldbody")
    for j, element in enumerate(e for e in world.iter() if e.tag in ("joint", "freejoint")):
        dof = model.jnt_dofadr[j]
        if element.tag == "joint":
            element.attrib.update(damping=exact(model.dof_damping[dof]), armature=exact(model.dof_armature[dof]),
                                  frictionloss=exact(model.dof_frictionloss[dof]))
    for a, element in enumerate(root.find("actuator") if model.nu else []):
        element.attrib.update(gainprm=exact(model.actuator_gainprm[a]), biasprm=exact(model.actuator_biasprm[a]))
    for b, body in enumerate(world.iter("body"), start=1):
        if scaled[b]:
            body.find("inertial").attrib.update(mass=exact(model.body_mass[b]), diaginertia=exact(model.body_inertia[b]),
                                                pos=exact(model.body_ipos[b]), quat=exact(model.body_iquat[b]))
    path.write_text(ElementTree.tostring(root, encoding="unicode"))


def plot_replay(task: Task, replayer: Replayer, prior: PhysicalParams, fitted: PhysicalParams, path: Path) -> None:
    """Logged vs replayed joint positions (prior and fitted twin) on the three worst windows under the prior."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replays = replayer.replay([prior, fitted])
    worst = np.argsort(-((replays[0] - replayer.win.target) ** 2).mean(axis=(1, 2)))[:3]
    joints = replayer.joints
    fig, axes = plt.subplots(len(joints), len(worst), figsize=(4 * len(worst), 2.4 * len(joints)), squeeze=False)
    t = (np.arange(replayer.win.target.shape[1]) + 1) * task.ctrl_dt
    for col, w in enumerate(worst):
        for row, j in enumerate(joints):
            ax = axes[row, col]
            ax.plot(t, replayer.win.target[w, :, j], "k.", ms=3, label="logged")
            ax.plot(t, replays[0, w, :, j], "C3--", label="prior model")
            ax.plot(t, replays[1, w, :, j], "C0-", label="calibrated twin")
            ax.set_title(f"window {w}, qpos[{j}]", fontsize=9)
            ax.set_xlabel("s")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{task.name}: logged vs replayed joint positions")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def twin_from_file(path: Path | None, task: str) -> TwinSpec:
    """A TwinSpec read back from its ``twin.json`` (None: the task's nominal model, uncalibrated)."""
    if path is None:
        nominal = load(task).nominal_params()
        return TwinSpec(path=Path("nominal"), digest="nominal", task=task, params=nominal,
                        dataset_digest="", replay_error_before=0.0, replay_error_after=0.0)
    spec = json.loads(Path(path).read_text())
    truth = spec.get("standin_truth")
    return TwinSpec(path=Path(path), digest=spec["digest"], task=task, params=PhysicalParams(**spec["params"]),
                    intervals=spec.get("intervals", {}), unidentified=tuple(spec.get("unidentified", ())),
                    dataset_digest=spec.get("dataset_digest", ""),
                    standin_truth=PhysicalParams(**{k: v for k, v in truth.items() if k != "label"}) if truth else None,
                    replay_error_before=spec["replay_error_before"], replay_error_after=spec["replay_error_after"],
                    misfit=Misfit(**spec["misfit"]) if spec.get("misfit") else None)
