"""``arm6``: forward kinematics, reachable 3D targets held as commands (a mocap body follows them), success, servo
gain randomization."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mujoco
import numpy as np
import pytest

from stages.sim.arm6 import Arm6
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams, apply_params
from stages.sim.registry import load


@pytest.fixture(scope="module")
def arm():
    return load("arm6")


def test_fingertip_kinematics_match_mujoco(arm):
    data = mujoco.MjData(arm.model)
    for q in np.random.default_rng(0).uniform(-3, 3, size=(5, arm.model.nq)):
        data.qpos[:] = q
        mujoco.mj_kinematics(arm.model, data)
        np.testing.assert_allclose(arm.fingertip(q[None])[0], data.site("fingertip").xpos, atol=1e-12)


@dataclass(frozen=True)
class Arm6SeesItsMarker(Arm6):
    """arm6 with a frame-position sensor on its mocap target (read from ``sensordata``, not observed): where the
    physics puts the marker."""

    def edit(self, spec: mujoco.MjSpec) -> None:
        super().edit(spec)
        spec.add_sensor(name="marker", type=mujoco.mjtSensor.mjSENS_FRAMEPOS, objtype=mujoco.mjtObj.mjOBJ_XBODY,
                        objname=self.mocap_body)


def test_targets_are_reachable_3d_commands_that_stay_put_and_move_the_mocap_marker(arm):
    target = arm.sample_commands(np.random.default_rng(0), 500)
    assert target[:, 2].min() >= arm.min_target_height and np.ptp(target, axis=0).min() > 0.5  # spread in x, y and z
    assert np.linalg.norm(target - [0, 0, 0.2], axis=1).max() <= 0.3 + 0.25 + 0.08 + 0.06 + 0.07 + 1e-5  # within reach
    assert arm.model.nq == 6  # the target is not in the robot's state
    seen = Arm6SeesItsMarker()
    env = BatchedEnv(seen, 4, seed=1, nthread=1)
    marker = slice(seen.model.sensor_adr[seen.model.sensor("marker").id], None)
    start = env.command.copy()
    assert np.ptp(start, axis=0).min() > 0  # one target per environment
    rng = np.random.default_rng(2)
    for _ in range(arm.episode_steps - 1):
        env.step(rng.uniform(-1, 1, (4, 6)))
        np.testing.assert_array_equal(env.command, start)
        # the simulated marker sits at each environment's target
        np.testing.assert_allclose(env.sensordata[:, marker], start, atol=1e-6)
    env.step(rng.uniform(-1, 1, (4, 6)))  # the episodes end: new targets
    assert not np.isclose(env.command, start).any(axis=1).all()


def test_reaching_the_target_succeeds(arm):
    qpos, qvel = arm.initial_state(np.random.default_rng(0), 2)
    command = arm.sample_commands(np.random.default_rng(1), 2)
    command[0] = arm.fingertip(qpos[:1])[0]
    assert arm.succeeded(qpos, qvel, command).tolist() == [True, False]
    obs = arm.observe(qpos, qvel, command)
    np.testing.assert_allclose(obs[:, 12:15], command)
    np.testing.assert_allclose(obs[0, -3:], 0.0, atol=1e-6)
    assert arm.reward(qpos, qvel, np.zeros((2, 6)), command)[0] == pytest.approx(0.0, abs=1e-6)


def test_servo_gain_scales_stiffness_not_the_setpoint(arm):
    m = apply_params(copy.deepcopy(arm.model), arm.model, PhysicalParams(actuator_gain=1.2), arm.mass_mask)
    np.testing.assert_allclose(m.actuator_gainprm[:, 0], 1.2 * arm.model.actuator_gainprm[:, 0])
    np.testing.assert_allclose(-m.actuator_biasprm[:, 1] / m.actuator_gainprm[:, 0], 1.0)  # force 0 at q = setpoint
    assert np.array_equal(m.actuator_gear, arm.model.actuator_gear)


def test_a_position_setpoint_is_reached(arm):
    env = BatchedEnv(arm, 1, seed=0)
    action = np.array([[0.3, 0.2, -0.2, 0.4, -0.5, 0.3]])
    for _ in range(50):  # 1 s
        env.step(action)
    np.testing.assert_allclose(env.qpos[0], arm.action_default + arm.action_scale * action[0], atol=0.08)


MARKER = """
import json, numpy as np
from stages.sim.gym_env import TaskEnv
env = TaskEnv("arm6", render_mode="rgb_array")
out = []
for seed in (0, 1):
    env.reset(seed=seed)
    frame = env.render().astype(int)
    green = (frame[..., 1] > 150) & (frame[..., 0] < 110) & (frame[..., 2] < 110)
    out.append([int(green.sum()), *np.argwhere(green).mean(axis=0).tolist()])
print(json.dumps(out))
"""


def test_the_target_marker_shows_where_the_goal_is_in_renders():
    """In a child process: MuJoCo picks its GL backend at import."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", MARKER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (n0, *c0), (n1, *c1) = json.loads(done.stdout)
    assert n0 > 5 and n1 > 5, "the target marker is not in the frame"  # 0 when the marker stays at its origin
    assert np.abs(np.subtract(c0, c1)).max() > 3  # another goal, another place in the picture
