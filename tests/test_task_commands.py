"""Commands and goals in the task API: declared with units and ranges, sampled per episode and resampled every N
steps, held by the environment beside the physics, passed to the terms, snapshotted, and marked in the bundle's
I/O contract as inputs the robot's software provides."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from stages.io_spec import IOSpec
from stages.sim import registry
from stages.sim.arm6 import Arm6
from stages.sim.cartpole import CartPole
from stages.sim.env import BatchedEnv
from stages.sim.task import Command, Term
from tests.test_tasks import fails

RESAMPLE = 10


@dataclass(frozen=True)
class CartSetpoint(CartPole):
    """The cart-pole balancing at a commanded cart position, drawn again every ``RESAMPLE`` steps."""

    name: str = "cart_setpoint"
    observations: tuple = (*CartPole().observations, Term("cart_goal", "m", source="command"))
    commands: tuple = (Command("cart_goal", "m", -0.5, 0.5, resample_steps=RESAMPLE),)

    def observe(self, qpos, qvel, command):
        return np.concatenate([super().observe(qpos, qvel), command], axis=1).astype(np.float32)

    def reward(self, qpos, qvel, action, command):
        return (super().reward(qpos, qvel, action) - np.abs(qpos[:, 0] - command[:, 0])).astype(np.float32)

    def terminated(self, qpos, qvel, command):
        return super().terminated(qpos, qvel)

    def succeeded(self, qpos, qvel, command):
        return np.abs(qpos[:, 0] - command[:, 0]) < 0.1


@pytest.fixture()
def task(own_task):
    own_task("cart_setpoint", CartSetpoint)
    return registry.load("cart_setpoint")  # validated like any task


def test_commands_are_held_resampled_every_n_steps_and_reach_the_terms(task):
    env = BatchedEnv(task, 8, seed=3, terminate=False)
    rng = np.random.default_rng(0)
    seen = [env.command.copy()]
    for step in range(1, 3 * RESAMPLE + 1):
        held = env.command.copy()
        result = env.step(rng.uniform(-1, 1, (8, 1)))
        np.testing.assert_array_equal(result.obs[:, -1], env.command[:, 0])  # observe() got the command
        expected = task.reward(result.qpos, env.qvel, env.last_action, held)  # no episode ended: the state stepped
        np.testing.assert_allclose(result.reward, expected, rtol=1e-6)  # reward() got the one in force
        if step % RESAMPLE:
            np.testing.assert_array_equal(env.command, held)
        else:
            assert not np.isclose(env.command, held).any()  # every env drew a new goal
            seen.append(env.command.copy())
    goals = np.concatenate(seen)
    assert goals.min() >= -0.5 and goals.max() <= 0.5 and np.ptp(goals) > 0.5


def test_a_snapshot_restores_the_commands_exactly(task):
    env = BatchedEnv(task, 4, seed=1)
    actions = np.random.default_rng(5).uniform(-1, 1, (25, 4, 1))
    for a in actions[:7]:
        env.step(a)
    snap = env.snapshot()

    def run() -> np.ndarray:
        return np.stack([np.c_[env.step(a).obs, env.command] for a in actions[7:]])

    first = run()
    env.restore(snap)
    np.testing.assert_array_equal(run(), first)


def test_the_io_contract_marks_commands(task):
    terms = IOSpec.from_task(task).manifest_io("obs", "action")["input"]["terms"]
    assert [t["name"] for t in terms if t.get("source") == "command"] == ["cart_goal"]
    arm = IOSpec.from_task(registry.load("arm6")).manifest_io("obs", "action")["input"]["terms"]
    assert [t["name"] for t in arm if t.get("source") == "command"] == ["target_x", "target_y", "target_z"]


def test_malformed_commands_are_named(own_task):
    @dataclass(frozen=True)
    class Undeclared(CartSetpoint):
        commands: tuple = ()

    @dataclass(frozen=True)
    class Backwards(CartSetpoint):
        commands: tuple = (Command("cart_goal", "m", 0.5, -0.5),)

    @dataclass(frozen=True)
    class OutOfRange(CartSetpoint):
        def sample_commands(self, rng, n):
            return np.full((n, 1), 2.0, np.float32)

    @dataclass(frozen=True)
    class NotMocap(Arm6):
        mocap_body: str = "link1"

    @dataclass(frozen=True)
    class WrongMocapCommands(Arm6):
        mocap_commands: tuple = ("target_x", "target_y")

    fails(own_task, Undeclared, "observation term 'cart_goal' is a command but the task declares no command")
    fails(own_task, Backwards, "command 'cart_goal' needs a finite range low <= high")
    fails(own_task, OutOfRange, r"sample_commands\(\) gave shape \(2, 1\) or values outside the commands' ranges")
    fails(own_task, NotMocap, "mocap_body 'link1' is not a mocap body of arm6.xml")
    fails(own_task, WrongMocapCommands, r"mocap_commands \('target_x', 'target_y'\) must name three")


# -- sensors, per-sensor noise and latency, privileged terms ---------------------------------------------------------

@dataclass(frozen=True)
class SlowSensors(CartPole):
    """The cart position arrives two control steps late; the pole's rate carries its own noise."""

    name: str = "slow_sensors"
    observations: tuple = (Term("cart_pos", "m", delay_steps=2), *CartPole().observations[1:4],
                           Term("pole_angvel", "rad/s", noise=0.5))


def test_a_sensor_delay_and_its_own_noise_act_on_that_term_only(own_task):
    own_task("slow_sensors", SlowSensors)
    task = registry.load("slow_sensors")
    env = BatchedEnv(task, 64, seed=0, terminate=False)
    cart = [env.qpos[:, 0].copy()] * 3  # before the first step, the delayed value is the initial one
    rng = np.random.default_rng(1)
    for _ in range(6):
        obs = env.step(rng.uniform(-1, 1, (64, 1))).obs
        cart.append(env.qpos[:, 0].copy())
        np.testing.assert_allclose(obs[:, 0], cart[-3], rtol=1e-6)  # two steps late
        clean = CartPole.observe(task, env.qpos, env.qvel)
        np.testing.assert_allclose(obs[:, 1:4], clean[:, 1:4], rtol=1e-6)  # the others: on time, noise-free
        assert 0.35 < np.std(obs[:, 4] - clean[:, 4]) < 0.65  # the rate sensor's own noise (std 0.5)


def test_sensors_are_read_by_name_at_reset_too():
    quad = registry.load("quadruped")
    env = BatchedEnv(quad, 2, seed=0)
    np.testing.assert_allclose(env.sensordata, quad.sensordata_at(env.qpos, env.qvel))
    assert set(env.inputs()["sensor"]) == {"imu_velocity", "imu_gyro", "imu_orientation"}

    @dataclass(frozen=True)
    class NoSuchSensor(CartPole):
        sensors: tuple = ("imu",)

    with pytest.raises(ValueError, match=r"sensor 'imu' is not in cartpole.xml \(sensors: \[\]\)"):
        NoSuchSensor().validate()


def test_an_actor_that_reads_a_privileged_term_is_not_exported(tmp_path):
    from stages.export import ExportConfig, PrivilegedInput, export_module
    from stages.io_spec import ObservationTerm

    quad = registry.load("quadruped")
    spec = IOSpec.from_task(quad)
    leaky = spec.model_copy(update={"observations": [*spec.observations, ObservationTerm(name="torso_height", unit="m")]})
    module = torch_linear(49, 12)
    with pytest.raises(PrivilegedInput, match=r"reads privileged \(simulator-only\) term\(s\) \['torso_height'\]"):
        export_module(ExportConfig(), module, np.zeros(49, np.float32), np.ones(49, np.float32), leaky, tmp_path / "x",
                      task_ref="quadruped")
    with pytest.raises(PrivilegedInput, match="the actor takes 49 inputs but task 'quadruped' has 48"):
        export_module(ExportConfig(), module, np.zeros(49, np.float32), np.ones(49, np.float32), spec, tmp_path / "y",
                      task_ref="quadruped")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def torch_linear(n_in: int, n_out: int):
    import torch

    return torch.nn.Linear(n_in, n_out)
