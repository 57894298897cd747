"""Training randomizes over the twin's intervals (issue 33): ranges, per-joint spread, empty intervals unchanged."""

from __future__ import annotations

import copy

import mujoco
import numpy as np
import pytest

from flows.chain import over_twin
from stages.artifacts import TwinSpec
from stages.sim import registry
from stages.sim.env import BatchedEnv
from stages.sim.params import MAX_SPREAD, PhysicalParams, Randomization, apply_params, sample_params_batch
from stages.train_config import TrainConfig
from stages.twin.twin_files import write_mjcf

TWIN = PhysicalParams(damping=1.3, actuator_gain=0.9, friction=0.05, damping_by_joint={"joint0": 1.2})
INTERVALS = {"damping": (1.0, 1.8), "actuator_gain": (0.85, 0.95), "friction": (0.0, 0.3),
             "damping_by_joint.joint0": (0.9, 1.6), "damping_by_joint.joint1": (0.7, 1.1),
             "gain_by_actuator.joint0": (0.2, 5.0), "friction_by_joint.joint1": (0.01, 0.2)}


def test_ranges_are_the_union_of_the_task_and_the_twin():
    r = Randomization(damping=0.2, actuator_gain=0.1, friction=0.02).around(TWIN, INTERVALS)
    assert r.ranges["damping"] == pytest.approx((1.0, 1.8))  # the interval is wider than 1.3 × (1 ± 0.2)
    assert r.ranges["actuator_gain"] == pytest.approx((0.81, 0.99))  # the task's ± 10% is wider
    assert r.ranges["friction"] == pytest.approx((0.0, 0.3))
    assert r.ranges["damping_by_joint.joint0"] == pytest.approx((0.9, 1.6))
    assert r.ranges["gain_by_actuator.joint0"] == pytest.approx((1 / MAX_SPREAD, MAX_SPREAD))  # search range, cut
    assert r.ranges["friction_by_joint.joint1"] == pytest.approx((0.01, 0.2))


def test_samples_fall_inside_and_cover_the_ranges():
    r = Randomization().around(TWIN, INTERVALS)
    drawn = sample_params_batch(TWIN, r, np.random.default_rng(0), 4000)
    values = {"damping": [p.damping for p in drawn], "actuator_gain": [p.actuator_gain for p in drawn],
              "friction": [p.friction for p in drawn],
              **{f"damping_by_joint.{j}": [p.damping_by_joint[j] for p in drawn] for j in ("joint0", "joint1")},
              "gain_by_actuator.joint0": [p.gain_by_actuator["joint0"] for p in drawn],
              "friction_by_joint.joint1": [p.friction_by_joint["joint1"] for p in drawn]}
    for key, v in values.items():
        lo, hi = r.ranges[key]
        assert lo <= min(v) and max(v) <= hi, key
        assert min(v) - lo < 0.01 * (hi - lo) and hi - max(v) < 0.01 * (hi - lo), key
    assert np.corrcoef(values["damping_by_joint.joint0"], values["damping_by_joint.joint1"])[0, 1] < 0.1


def test_empty_intervals_reproduce_todays_samples():
    task = registry.load("reacher")
    base = Randomization(damping=0.2, actuator_gain=0.1, mass=0.2, friction=0.01, obs_noise=0.01, latency_steps=2)
    assert base.around(TWIN, {}) == base
    a, b = (BatchedEnv(task, 16, params=TWIN, randomization=r, seed=3) for r in (base, base.around(TWIN, {})))
    a.reset(np.arange(16) % 2 == 0), b.reset(np.arange(16) % 2 == 0)
    assert a.params == b.params and a.rng.bit_generator.state == b.rng.bit_generator.state


def test_per_joint_intervals_spread_the_envs_per_joint():
    task = registry.load("reacher")
    r = task.randomization.around(TWIN, {"damping_by_joint.joint1": (0.5, 2.0)})
    env = BatchedEnv(task, 64, params=TWIN, randomization=r, seed=0)
    dof = [task.model.jnt_dofadr[mujoco.mj_name2id(task.model, mujoco.mjtObj.mjOBJ_JOINT, j)]
           for j in ("joint0", "joint1")]
    damping = np.stack([m.dof_damping[dof] for m in env.models])
    ratio = damping[:, 1] / damping[:, 0] / (task.model.dof_damping[dof[1]] / task.model.dof_damping[dof[0]])
    assert np.allclose(ratio * 1.2, [p.damping_by_joint["joint1"] for p in env.params])  # joint0 keeps its 1.2
    assert ratio.min() * 1.2 < 0.6 and ratio.max() * 1.2 > 1.8


def test_per_joint_samples_repeat_and_restore():
    task = registry.load("reacher")
    r = task.randomization.around(TWIN, {"damping_by_joint.joint1": (0.5, 2.0)})
    env = BatchedEnv(task, 4, params=TWIN, randomization=r, seed=0)
    snap, damping = env.snapshot(), np.stack([m.dof_damping for m in env.models])
    env.reset()
    env.restore(snap)
    assert np.array_equal(np.stack([m.dof_damping for m in env.models]), damping)
    assert BatchedEnv(task, 4, params=TWIN, randomization=r, seed=0).params == env.params  # same seed, same draws


def test_over_twin_takes_the_identified_intervals():
    spec = TwinSpec(path="twin.json", digest="d", task="reacher", params=TWIN, dataset_digest="x",
                    replay_error_before=1.0, replay_error_after=0.1, unidentified=("mass",),
                    intervals={"damping": (1.0, 1.8), "mass": (0.2, 5.0), "damping_by_joint.joint0": (0.9, 1.6)})
    cfg = over_twin(TrainConfig(task="reacher", seed=4), spec)
    assert cfg.twin_intervals == {"damping": (1.0, 1.8), "damping_by_joint.joint0": (0.9, 1.6)} and cfg.seed == 4
    assert over_twin(TrainConfig(), spec.model_copy(update={"intervals": {}})).twin_intervals == {}


def test_unknown_range_is_refused():
    with pytest.raises(ValueError, match="no randomizable"):
        Randomization(ranges={"latency_steps": (0.0, 1.0)})
    with pytest.raises(ValueError, match="0 < lo"):
        Randomization(ranges={"damping": (0.0, 1.0)})


def test_in_memory_twin_replays_like_twin_xml(tmp_path):
    """Mass and armature enter MuJoCo's derived constants: ``apply_params`` recomputes them (``mj_setConst``), as
    compiling ``twin.xml`` does; without it the quadruped's two replays differ by 0.065 within 300 steps."""
    task = registry.load("quadruped")
    params = PhysicalParams(damping=1.3, actuator_gain=0.9, armature=1.4, mass=1.35, friction=0.02)
    write_mjcf(task, params, tmp_path / "twin.xml")
    ctrl = np.random.default_rng(0).uniform(*task.model.actuator_ctrlrange.T, (300, task.model.nu))
    twin = _replay(apply_params(copy.deepcopy(task.model), task.model, params, task.mass_mask), ctrl)
    np.testing.assert_allclose(_replay(mujoco.MjModel.from_xml_path(str(tmp_path / "twin.xml")), ctrl), twin, atol=1e-9)


def _replay(model: mujoco.MjModel, ctrl: np.ndarray) -> np.ndarray:
    """(T, nq) positions under ``ctrl`` from ``qpos0``."""
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    out = []
    for u in ctrl:
        data.ctrl[:] = u
        mujoco.mj_step(model, data)
        out.append(data.qpos.copy())
    return np.array(out)
