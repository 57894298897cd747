"""``arm6``: forward kinematics, reachable 3D targets that stay put, success, servo gain randomization."""

from __future__ import annotations

import copy

import mujoco
import numpy as np
import pytest

from stages.sim.arm6 import ARM, TARGET
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


def test_targets_are_reachable_3d_and_stay_put(arm):
    qpos, qvel = arm.initial_state(np.random.default_rng(0), 500)
    target = qpos[:, TARGET]
    assert target[:, 2].min() >= arm.min_target_height and np.ptp(target, axis=0).min() > 0.5  # spread in x, y and z
    assert np.linalg.norm(target - [0, 0, 0.2], axis=1).max() <= 0.3 + 0.25 + 0.08 + 0.06 + 0.07 + 1e-9  # within reach
    env = BatchedEnv(arm, 4, seed=1)
    start = env.qpos[:, TARGET].copy()
    for _ in range(arm.episode_steps - 1):
        env.step(np.random.default_rng(2).uniform(-1, 1, (4, 6)))
    np.testing.assert_allclose(env.qpos[:, TARGET], start, atol=1e-9)  # weightless, no contacts


def test_reaching_the_target_succeeds(arm):
    qpos, qvel = arm.initial_state(np.random.default_rng(0), 2)
    qpos[0, TARGET] = arm.fingertip(qpos[:1])[0]
    assert arm.succeeded(qpos, qvel).tolist() == [True, False]
    obs = arm.observe(qpos, qvel)
    np.testing.assert_allclose(obs[0, -3:], 0.0, atol=1e-6)
    assert arm.reward(qpos, qvel, np.zeros((2, 6)))[0] == pytest.approx(0.0, abs=1e-6)


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
    np.testing.assert_allclose(env.qpos[0, ARM], arm.action_default + arm.action_scale * action[0], atol=0.08)
