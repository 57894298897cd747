"""``quadruped``: the 48-term observation, velocity command, falls; trained, exported, evaluated and packaged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge import bundle, signing
from edge.smoke import smoke_test
from stages.artifacts import TwinSpec
from stages.export import ExportConfig, export
from stages.io_spec import IOSpec
from stages.package import PackageConfig, build_manifest, package
from stages.sim.disturbance import Disturbance
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.quadruped import JOINTS
from stages.sim.registry import load
from stages.train import train
from stages.train_config import TrainConfig
from stages.twin.evaluate import EvalConfig, evaluate
from stages.twin.gate import GateConfig


@pytest.fixture(scope="module")
def quad():
    return load("quadruped")


def test_observation_is_the_classic_48_term_layout(quad):
    names = [o.name for o in quad.observations]
    assert len(names) == 48 and names[:12] == ["base_vx", "base_vy", "base_vz", "base_wx", "base_wy", "base_wz",
                                                "gravity_x", "gravity_y", "gravity_z", "command_vx", "command_vy",
                                                "command_yaw_rate"]
    assert names[12:] == [f"{j}_{k}" for k in ("pos", "vel") for j in JOINTS] + [f"last_action_{j}" for j in JOINTS]
    assert [a.joint for a in quad.actions] == list(JOINTS)
    qpos, qvel = quad.initial_state(np.random.default_rng(0), 1)
    qpos[0, 3:7] = (np.cos(np.pi / 4), 0, 0, np.sin(np.pi / 4))  # facing world +y
    qvel[0, :6] = (1.0, 0.0, 0.0, 0.0, 0.0, 0.5)  # moving along world +x, yawing
    command = np.array([[0.5, -0.2, 0.3]], np.float32)
    obs = quad.observe(qpos, qvel, np.zeros((1, 12), np.float32), command,
                       quad.readings(quad.sensordata_at(qpos, qvel)))[0]
    np.testing.assert_allclose(obs[:9], [0, -1, 0, 0, 0, 0.5, 0, 0, -1], atol=1e-6)  # body frame: sideways, to the right
    np.testing.assert_allclose(obs[9:12], command[0])


def test_the_io_contract_marks_the_command_and_the_critic_sees_the_height(quad):
    terms = IOSpec.from_task(quad).manifest_io("obs", "action")["input"]["terms"]
    assert [t["name"] for t in terms if t.get("source") == "command"] == ["command_vx", "command_vy",
                                                                          "command_yaw_rate"]
    assert "torso_height" not in [t["name"] for t in terms] and len(terms) == 48
    env = BatchedEnv(quad, 3, seed=0)
    np.testing.assert_allclose(env.privileged()[:, 0], env.qpos[:, 2], rtol=1e-6)


def test_standing_still_neither_falls_nor_drifts(quad):
    env = BatchedEnv(quad, 8, seed=0)
    command = env.command.copy()
    low, high = np.array([[c.low, c.high] for c in quad.commands]).T
    assert np.all((command >= low) & (command <= high)) and np.ptp(command, axis=0).min() > 0
    falls = 0
    for _ in range(quad.episode_steps - 1):
        falls += env.step(np.zeros((8, 12))).terminated.sum()
    assert falls == 0 and np.all(env.qpos[:, 2] > 0.25)
    np.testing.assert_array_equal(env.command, command)  # one command per episode


def test_last_action_is_observed_and_cleared_on_reset(quad):
    env = BatchedEnv(quad, 2, seed=0)
    action = np.full((2, 12), 0.25)
    r = env.step(action)
    np.testing.assert_allclose(r.obs[:, -12:], 0.25)
    assert np.all(env.reset()[:, -12:] == 0)


def test_a_tipped_torso_is_a_fall(quad):
    qpos, qvel = quad.initial_state(np.random.default_rng(0), 3)
    qpos[1, 2] = 0.1  # torso on the ground
    qpos[2, 3:7] = (np.cos(0.6), np.sin(0.6), 0, 0)  # rolled 1.2 rad
    assert quad.terminated(qpos, qvel, np.zeros((3, 3)), {}).tolist() == [False, True, True]


def constant_onnx(path: Path, ctrl: np.ndarray) -> Path:
    """A real ONNX graph that outputs the same actuator controls for every observation: obs @ 0 + ctrl."""
    from onnx import TensorProto, helper, numpy_helper

    zeros = numpy_helper.from_array(np.zeros((48, 12), np.float32), "W")
    bias = numpy_helper.from_array(np.asarray(ctrl, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["obs", "W"], ["y"]), helper.make_node("Add", ["y", "b"], ["action"])], "constant",
        [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 48])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", 12])], [zeros, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_evaluation_counts_falls(quad, tmp_path):
    from stages.twin.evaluate import episodes_in
    from stages.twin.suite import Scenario

    standing = constant_onnx(tmp_path / "stand.onnx", quad.action_default)
    # left legs abducted inwards, right legs outwards, front hips forward: the torso rolls over
    rolling = constant_onnx(tmp_path / "roll.onnx", np.tile([0.5, 1.0, -1.0, -0.5, 0.3, -1.0], 2))
    nominal = Scenario(name="nominal")
    stand = episodes_in(standing, "quadruped", nominal, PhysicalParams(), 0, 4)
    roll = episodes_in(rolling, "quadruped", nominal, PhysicalParams(), 0, 4)
    assert not stand.fell.any() and stand.success.all() and np.all(stand.steps == quad.episode_steps)
    assert roll.fell.all() and not roll.success.any() and np.all(roll.steps < quad.episode_steps)


def test_quadruped_suite_pushes_the_base_and_counts_falls(quad, tmp_path):
    from stages.artifacts import ExportedPolicy
    from stages.twin.twin_files import twin_from_file
    from stages.twin.evaluate import episodes_in
    from stages.twin.suite import SUITES, Scenario, load_suite, suite_path

    assert suite_path("quadruped") == SUITES / "quadruped.yaml"
    suite = load_suite(suite_path("quadruped"))
    default = {s.name: s for s in load_suite(SUITES / "default.yaml").scenarios}
    mine = {s.name: s for s in suite.scenarios}
    assert set(mine) == set(default) - {"pushes"} | {"base-push"}
    assert all(mine[name] == default[name] for name in set(mine) - {"base-push"})
    push = mine["base-push"].disturbance
    assert push.push_on == "base" and push.push > 0 and mine["base-push"].min_success_rate is not None

    standing = constant_onnx(tmp_path / "stand.onnx", quad.action_default)
    policy = ExportedPolicy(path=standing, digest="stand" * 4, task="quadruped", opset=17, parity_max_abs_error=0.0,
                            golden=standing)
    report = evaluate(EvalConfig(episodes=4, video=False), GateConfig(), policy, twin_from_file(None, "quadruped"),
                      tmp_path / "eval")
    import json

    rows = {r["scenario"]: r for r in json.loads(report.path.read_text())["scenarios"]}
    assert list(rows) == [s.name for s in suite.scenarios] and rows["base-push"]["episodes"] == 4
    assert rows["base-push"]["falls"] == 0 and rows["base-push"]["success_rate"] == 1.0  # the stance holds 0.5 × weight
    assert any(r.startswith("pass: base-push: success rate") for r in report.reasons)
    shove = Scenario(name="shove", disturbance=push.model_copy(update={"push": 2.0}))  # 2 × weight for 0.1 s
    shoved = episodes_in(standing, "quadruped", shove, PhysicalParams(), 1000, 4)
    assert shoved.fell.all() and not shoved.success.any() and np.all(shoved.steps < quad.episode_steps)


def test_init_spread_scales_around_the_standing_pose(quad):
    plain = BatchedEnv(quad, 4, seed=3)
    wide = BatchedEnv(quad, 4, seed=3, disturbance=Disturbance(init_spread=2.0))
    joints, ref = quad.joint_qpos, quad.reference_qpos[quad.joint_qpos]
    np.testing.assert_allclose(wide.qpos[:, joints] - ref, 2 * (plain.qpos[:, joints] - ref))


def test_trains_exports_evaluates_and_packages(quad, tmp_path, monkeypatch):
    seen = []
    ckpt = train(TrainConfig(task="quadruped", iterations=3, num_envs=16, steps_per_env=16, hidden_dims=(32, 32)),
                 PhysicalParams(), tmp_path / "ck", on_iteration=lambda it, m: seen.append(m))
    assert len(seen) == 3 and all(np.isfinite(v) for m in seen for k, v in m.items() if k.startswith("loss_"))
    policy = export(ExportConfig(parity_samples=200), ckpt, tmp_path / "onnx")
    twin = TwinSpec(path=Path("twin.json"), digest="twin" * 4, task="quadruped", params=PhysicalParams(),
                    dataset_digest="d", standin_truth=None, replay_error_before=1.0, replay_error_after=1.0)
    report = evaluate(EvalConfig(episodes=4, video=False), GateConfig(), policy, twin, tmp_path / "eval")
    import json

    rows = json.loads(report.path.read_text())["scenarios"]
    assert len(rows) == 8 and all(0 <= r["falls"] <= r["episodes"] for r in rows)
    assert all(r["nan_actions"] == 0 for r in rows) and report.latency_ms_p99 < quad.ctrl_dt * 1e3
    monkeypatch.delenv(signing.ENV_KEY, raising=False)
    cfg = PackageConfig()
    manifest = build_manifest(cfg, "quadruped", "1", policy, IOSpec.from_task(quad), {"test": True}, {"passed": report.passed})
    art = package(cfg, manifest, policy, tmp_path / "keys", tmp_path / "bundle.tar")
    (tmp_path / "x").mkdir()
    bundle.extract(art.path, tmp_path / "x", 1 << 26)
    verified = bundle.verify_dir(tmp_path / "x", signing.load_trusted([tmp_path / "keys" / "signing.pub"]))
    assert verified["io"]["input"]["shape"] == [-1, 48] and verified["io"]["input"]["terms"][-1]["name"] == "last_action_RL_knee"
    assert smoke_test(tmp_path / "x", verified).max_abs_error <= verified["parity_tolerance"]["fp32"]["atol"]
