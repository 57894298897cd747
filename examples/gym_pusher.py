"""A robot this project did not write: gymnasium's 7-DoF PR2-style arm (``pusher.xml``), reaching a 3D target.

The MJCF is loaded from the installed gymnasium package and never edited. What the task needs that the
file does not have is added to its parsed ``MjSpec`` in :meth:`PusherReach.edit`: a fingertip site on
``tips_arm``, a ``framepos`` sensor reading it (the fingertip position the robot's forward kinematics
reports), and a mocap body that follows the target, so renders show it. The target is three commands
(``target_x/y/z``), sampled per episode as the fingertip of a random joint configuration, so it is
reachable. The model's own puck and goal bodies (slide joints) stay as gymnasium ships them; calibration
replays the arm's seven joints only.

Use it as ``--task examples.gym_pusher:PusherReach``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mujoco
import numpy as np

from stages.sim.kinematics import SitePosition
from stages.sim.params import Randomization
from stages.sim.reacher import gymnasium_mjcf
from stages.sim.task import Command, Task, Term

JOINTS = ("r_shoulder_pan", "r_shoulder_lift", "r_upper_arm_roll", "r_elbow_flex", "r_forearm_roll", "r_wrist_flex",
          "r_wrist_roll")


@dataclass(frozen=True)
class PusherReach(Task):
    name: str = "pusher_reach"
    mjcf: Path = field(default_factory=lambda: gymnasium_mjcf("pusher.xml"))
    observations: tuple[Term, ...] = (
        *(Term(f"{j}_pos", "rad") for j in JOINTS),
        *(Term(f"{j}_vel", "rad/s") for j in JOINTS),
        *(Term(f"target_{a}", "m", source="command") for a in "xyz"),
        *(Term(f"tip_{a}", "m", noise=0.002) for a in "xyz"),  # the framepos sensor
        *(Term(f"tip_to_target_{a}", "m") for a in "xyz"),
    )
    actions: tuple[Term, ...] = tuple(Term(j, "N m", joint=f"{j}_joint") for j in JOINTS)  # motors, ctrl ±2 N m
    decimation: int = 5  # gymnasium's Pusher frame_skip: 10 ms physics, 50 ms control period
    episode_steps: int = 60  # 3 s
    randomization: Randomization = field(default_factory=lambda: Randomization(damping=0.2, actuator_gain=0.1, mass=0.1))
    success_threshold: float = -np.inf
    mass_bodies: tuple[str, ...] = tuple(f"{j}_link" for j in JOINTS)
    replayed_joints: tuple[str, ...] = tuple(f"{j}_joint" for j in JOINTS)
    # a box around every fingertip position the joint ranges reach (``sample_commands`` draws inside it)
    commands: tuple[Command, ...] = (Command("target_x", "m", -0.7, 0.9), Command("target_y", "m", -1.5, 0.3),
                                     Command("target_z", "m", -0.8, 0.6))
    mocap_body: str = "target"
    mocap_commands: tuple[str, ...] = ("target_x", "target_y", "target_z")
    sensors: tuple[str, ...] = ("tip_position",)
    success_distance: float = 0.1
    """An episode succeeds when it ends with the fingertip within this distance (m) of the target."""
    control_cost: float = 0.01

    def edit(self, spec: mujoco.MjSpec) -> None:
        spec.body("tips_arm").add_site(name="fingertip")
        spec.add_sensor(name="tip_position", type=mujoco.mjtSensor.mjSENS_FRAMEPOS,
                        objtype=mujoco.mjtObj.mjOBJ_SITE, objname="fingertip")
        target = spec.worldbody.add_body(name="target", mocap=True)
        target.add_geom(type=mujoco.mjtGeom.mjGEOM_SPHERE, size=[0.04, 0, 0], rgba=[0.9, 0.2, 0.2, 0.6],
                        contype=0, conaffinity=0)

    @cached_property
    def fingertip(self) -> SitePosition:
        return SitePosition(self.model, "fingertip")

    @cached_property
    def arm_qpos(self) -> np.ndarray:
        return np.array([self.model.joint(j).qposadr[0] for j in self.replayed_joints])

    @cached_property
    def arm_qvel(self) -> np.ndarray:
        return np.array([self.model.joint(j).dofadr[0] for j in self.replayed_joints])

    def initial_state(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        # arm ~ qpos0 + U(±0.1) rad inside its ranges, at rest; puck and goal where gymnasium's file puts them
        qpos = np.tile(self.model.qpos0, (n, 1))
        low, high = self.model.jnt_range[[self.model.joint(j).id for j in self.replayed_joints]].T
        qpos[:, self.arm_qpos] = np.clip(qpos[:, self.arm_qpos] + rng.uniform(-0.1, 0.1, (n, len(JOINTS))), low, high)
        return qpos, np.zeros((n, self.model.nv))

    @cached_property
    def arm_geoms(self) -> np.ndarray:
        """The geoms of the arm's bodies (every body from the shoulder down)."""
        arm = {self.model.joint(j).bodyid[0] for j in self.replayed_joints}
        arm |= {b for b in range(self.model.nbody) if self.model.body_parentid[b] in arm}
        return np.flatnonzero(np.isin(self.model.geom_bodyid, list(arm)))

    def touches(self, data: mujoco.MjData, qpos: np.ndarray) -> bool:
        """Whether the arm at ``qpos`` (one configuration, set in ``data``) is in contact with anything (the table,
        the puck)."""
        data.qpos[:] = qpos
        mujoco.mj_kinematics(self.model, data)
        mujoco.mj_collision(self.model, data)
        return bool(np.isin(data.contact.geom[:data.ncon], self.arm_geoms).any())

    def sample_commands(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Targets: the fingertip at :meth:`reachable_configurations`, so each one is reachable."""
        return self.fingertip(self.reachable_configurations(rng, n)).astype(np.float32)

    def reachable_configurations(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(n, nq) qpos0 with the arm's joints ~ U(joint ranges) where the arm touches nothing (about a third of the
        uniform draws put the wrist into the table: a fingertip position there cannot be reached)."""
        low, high = self.model.jnt_range[[self.model.joint(j).id for j in self.replayed_joints]].T
        qpos = np.tile(self.model.qpos0, (n, 1))
        todo, probe = np.arange(n), mujoco.MjData(self.model)  # a new one per call: threads share the task
        while todo.size:
            qpos[np.ix_(todo, self.arm_qpos)] = rng.uniform(low, high, (todo.size, len(JOINTS)))
            todo = todo[[self.touches(probe, q) for q in qpos[todo]]]
        return qpos

    def distance(self, qpos: np.ndarray, command: np.ndarray) -> np.ndarray:
        return np.linalg.norm(self.fingertip(qpos) - command, axis=1)

    def observe(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray, sensor: dict[str, np.ndarray]) -> np.ndarray:
        tip = sensor["tip_position"]
        return np.concatenate([qpos[:, self.arm_qpos], qvel[:, self.arm_qvel], command, tip, command - tip],
                              axis=1).astype(np.float32)

    def reward(self, qpos: np.ndarray, qvel: np.ndarray, action: np.ndarray, command: np.ndarray,
               sensor: dict[str, np.ndarray]) -> np.ndarray:
        return (-self.distance(qpos, command) - self.control_cost * np.sum(action**2, axis=1)).astype(np.float32)

    def terminated(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                   sensor: dict[str, np.ndarray]) -> np.ndarray:
        return np.zeros(len(qpos), dtype=bool)

    def succeeded(self, qpos: np.ndarray, qvel: np.ndarray, command: np.ndarray,
                  sensor: dict[str, np.ndarray]) -> np.ndarray:
        return self.distance(qpos, command) < self.success_distance
