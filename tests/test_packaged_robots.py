"""Robots this project did not write, loaded unedited from an installed package (gymnasium's ``ant.xml`` and
``pusher.xml``), through the own-robot path: ``module:Class``, additions made on the parsed ``MjSpec`` only."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from importlib.resources import files
from pathlib import Path

import mujoco
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from stages.export import IOSpec
from stages.sim.env import BatchedEnv
from stages.sim.gym_env import TaskEnv
from stages.sim.registry import load
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[1]
GYM_ASSETS = Path(str(files("gymnasium") / "envs" / "mujoco" / "assets"))
ROBOTS = {"examples.gym_ant:AntVelocity": ("ant.xml", ("imu_gyro", "imu_orientation", "imu_velocity"), ""),
          "examples.gym_pusher:PusherReach": ("pusher.xml", ("tip_position",), "target")}


@pytest.mark.parametrize("ref", ROBOTS)
def test_the_mjcf_is_the_installed_file_and_the_additions_live_in_the_spec(ref):
    task = load(ref)
    file, sensors, mocap = ROBOTS[ref]
    assert task.mjcf == GYM_ASSETS / file
    shipped = mujoco.MjModel.from_xml_path(str(task.mjcf))
    assert shipped.nsensor == 0 and shipped.nmocap == 0  # the file has neither: the task added them
    m = task.model
    assert sorted(m.sensor(i).name for i in range(m.nsensor)) == sorted(sensors)
    assert m.nmocap == (1 if mocap else 0) and m.nq == shipped.nq and m.nu == shipped.nu
    assert np.array_equal(m.qpos0, shipped.qpos0) and np.array_equal(m.body_mass[:shipped.nbody], shipped.body_mass)
    task.validate()


def test_loading_leaves_the_installed_files_byte_for_byte():
    before = {f: hashlib.sha256((GYM_ASSETS / f).read_bytes()).hexdigest() for f, _, _ in ROBOTS.values()}
    for ref in ROBOTS:
        load(ref).spec().compile()
    assert {f: hashlib.sha256((GYM_ASSETS / f).read_bytes()).hexdigest() for f in before} == before


def test_every_pusher_target_is_reachable_by_a_joint_space_controller_within_an_episode():
    """A third of uniform joint draws put the wrist into the table; targets there capped any policy near 0.8."""
    task = load("examples.gym_pusher:PusherReach")
    m, rng = task.model, np.random.default_rng(3)
    ids = [m.joint(j).id for j in task.replayed_joints]
    uniform = np.tile(m.qpos0, (200, 1))
    uniform[:, task.arm_qpos] = rng.uniform(*m.jnt_range[ids].T, (200, len(ids)))
    probe = mujoco.MjData(m)
    assert np.mean([task.touches(probe, q) for q in uniform]) > 0.2  # why targets are not drawn so
    goals = task.reachable_configurations(rng, 40)
    assert not any(task.touches(probe, q) for q in goals)
    starts, _ = task.initial_state(rng, 40)
    reached = []
    for start, goal in zip(starts, goals):  # PD on the joints to the configuration that made the target
        d = mujoco.MjData(m)
        d.qpos[:] = start
        for _ in range(task.episode_steps * task.decimation):
            d.ctrl[:] = np.clip(50 * (goal[task.arm_qpos] - d.qpos[task.arm_qpos]) - 5 * d.qvel[task.arm_qvel], -2, 2)
            mujoco.mj_step(m, d)
        reached.append(task.distance(d.qpos[None], task.fingertip(goal[None]))[0] < task.success_distance)
    assert np.mean(reached) == 1.0


def test_pusher_mocap_target_follows_the_command_and_the_tip_sensor_matches_the_kinematics():
    task = load("examples.gym_pusher:PusherReach")
    env = BatchedEnv(task, 3, seed=1)
    env.reset()
    np.testing.assert_allclose(env.mocap_positions(), env.command, atol=1e-6)  # one mocap body: (N, 3)
    qpos, qvel = task.initial_state(np.random.default_rng(0), 4)
    tip = task.readings(task.sensordata_at(qpos, qvel))["tip_position"]
    np.testing.assert_allclose(tip, task.fingertip(qpos), atol=1e-9)
    spec = IOSpec.from_task(task)
    assert [t.name for t in spec.observations if t.source == "command"] == ["target_x", "target_y", "target_z"]


def test_ant_velocity_is_privileged_and_a_fall_terminates():
    task = load("examples.gym_ant:AntVelocity")
    names = [t.name for t in IOSpec.from_task(task).observations]
    assert not {"base_vx", "base_vy", "base_vz"} & set(names) and "base_wx" in names
    env = BatchedEnv(task, 2, seed=0)
    env.reset()
    assert env.privileged().shape == (2, 3)
    qpos, qvel = np.tile(task.model.qpos0, (2, 1)), np.zeros((2, task.model.nv))
    qpos[1, 2] = 0.2  # torso on the ground
    sensor = task.readings(task.sensordata_at(qpos, qvel))
    assert task.terminated(qpos, qvel, np.zeros((2, 3)), sensor).tolist() == [False, True]


@pytest.mark.parametrize("ref", ROBOTS)
def test_gymnasium_env_checker_passes(ref):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(TaskEnv(ref), skip_render_check=True)
    # gymnasium's hint on ±inf bounds (its own MuJoCo envs get it too) is the only message allowed
    assert [str(w.message) for w in caught if "Box observation space m" not in str(w.message)] == []


@pytest.mark.slow
@pytest.mark.parametrize("ref", ROBOTS)
def test_sim2edge_run_takes_the_robot_from_stand_in_logs_to_a_signed_bundle(tmp_path, ref):
    """collect (stand-in) → calibrate → train → export → evaluate → package → register, with a tiny budget."""
    budget = ["collect_episodes=2", "num_envs=8", "train.steps_per_env=8", "calibrate.max_windows=16",
              "calibrate.generations=4", "calibrate.search_generations=2", "calibrate.joint_steps=4",
              "calibrate.bootstrap=20"]
    r = run_cli("sim2edge", "run", "--task", ref, "--iterations", "2", "--eval-episodes", "2",
                *(a for kv in budget for a in ("--set", kv)), cwd=REPO,
                env={"SIM2EDGE_HOME": str(tmp_path)}, unset=("MLFLOW_TRACKING_URI", "PREFECT_API_URL"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    name = load(ref).name
    assert re.search(rf"sim2edge-agent pull {name}@\w+", r.stdout)
    (twin,) = tmp_path.glob("runs/*/twin/twin.json")
    assert json.loads(twin.read_text())["task"] == ref
    assert mujoco.MjModel.from_xml_path(str(twin.with_name("twin.xml"))).nsensor == load(ref).model.nsensor
    (bundle,) = tmp_path.glob("runs/*/bundle/bundle.tar")
    assert bundle.stat().st_size > 0
