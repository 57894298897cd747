"""A malformed task fails at registration, and the error names the term, field or value at fault."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from stages.sim import registry
from stages.sim.arm6 import Arm6
from stages.sim.cartpole import ASSETS, CartPole
from stages.sim.task import Term


def fails(own_task, cls, match: str) -> None:
    own_task("broken", cls)
    for _ in range(2):  # a task that fails validation is not kept: the second load checks again
        with pytest.raises(ValueError, match=match):
            registry.load("broken")


def test_action_count_must_match_the_actuators(own_task):
    @dataclass(frozen=True)
    class TwoActions(CartPole):
        actions: tuple = (Term("slide", "N"), Term("ghost", "N"))

    fails(own_task, TwoActions, "2 action terms but the MJCF has 1 actuators")


def test_missing_and_repeated_terms_are_named(own_task):
    @dataclass(frozen=True)
    class NoObservations(CartPole):
        observations: tuple = ()

    @dataclass(frozen=True)
    class Repeated(CartPole):
        observations: tuple = (Term("cart_pos", "m"), Term("pole_cos", "1"), Term("pole_sin", "1"),
                               Term("cart_pos", "m"), Term("pole_angvel", "rad/s"))

    fails(own_task, NoObservations, "no observation terms")
    fails(own_task, Repeated, "observation term 'cart_pos' repeats")


def test_an_action_on_a_joint_without_actuator_is_refused(own_task):
    base = Arm6().actions

    @dataclass(frozen=True)
    class OnPole(CartPole):
        actions: tuple = (Term("slide", "N", joint="hinge"),)

    @dataclass(frozen=True)
    class Unknown(Arm6):
        actions: tuple = (*base[:5], Term("wrist_flex", "rad", joint="gripper"))

    @dataclass(frozen=True)
    class Swapped(Arm6):
        actions: tuple = (base[1], base[0], *base[2:])

    fails(own_task, OnPole, "action term 'slide': joint 'hinge' has no actuator")
    fails(own_task, Unknown, "action term 'wrist_flex': joint 'gripper' is not in arm6.xml")
    fails(own_task, Swapped, "action term 'shoulder_lift' is number 0, but actuator 0 does not drive joint 'shoulder_lift'")


def test_nan_in_the_model_is_named(own_task, tmp_path):
    xml = tmp_path / "nan_cartpole.xml"
    xml.write_text((ASSETS / "cartpole.xml").read_text().replace('axis="0 1 0" damping="0.05"', 'axis="0 1 0" damping="nan"'))

    @dataclass(frozen=True)
    class NanDamping(CartPole):
        mjcf: Path = xml

    fails(own_task, NanDamping, "nan_cartpole.xml has NaN/Inf in dof_damping of #1")


def test_wrong_shapes_and_nan_terms_are_named(own_task):
    @dataclass(frozen=True)
    class ShortObservation(CartPole):
        def observe(self, qpos, qvel):
            return super().observe(qpos, qvel)[:, :4]

    @dataclass(frozen=True)
    class NanTerm(CartPole):
        def observe(self, qpos, qvel):
            obs = super().observe(qpos, qvel)
            obs[:, 3] = np.nan
            return obs

    @dataclass(frozen=True)
    class ColumnReward(CartPole):
        def reward(self, qpos, qvel, action):
            return super().reward(qpos, qvel, action)[:, None]

    @dataclass(frozen=True)
    class WrongState(CartPole):
        def initial_state(self, rng, n):
            qpos, qvel = super().initial_state(rng, n)
            return qpos[:, :1], qvel

    @dataclass(frozen=True)
    class FloatTermination(CartPole):
        def terminated(self, qpos, qvel):
            return np.zeros(len(qpos))

    fails(own_task, ShortObservation, r"observe\(\) gave shape \(2, 4\), expected \(N, 5\) for the observation "
                                         r"terms cart_pos, pole_cos")
    fails(own_task, NanTerm, "NaN/Inf in observation term 'cart_vel'")
    fails(own_task, ColumnReward, r"reward\(\) gave shape \(2, 1\), expected \(N,\)")
    fails(own_task, WrongState, r"initial_state qpos has shape \(2, 1\), expected \(2, 2\)")
    fails(own_task, FloatTermination, r"terminated\(\) gave shape \(2,\) dtype float64, expected \(N,\) bool")


def test_a_well_formed_subclass_registers(own_task):
    @dataclass(frozen=True)
    class Longer(CartPole):
        episode_steps: int = 300

    own_task("broken", Longer)
    assert registry.load("broken").episode_steps == 300


def test_a_term_that_turns_nan_after_the_first_step_stops_training_naming_it(own_task, tmp_path):
    """Registration sees finite initial states; the first NaN in a rollout stops training at iteration 0,
    naming the term, the env and the step, before NaN actions can make the physics unstable."""
    from stages.sim.params import PhysicalParams
    from stages.train import NonFiniteTraining, train
    from stages.train_config import TrainConfig

    @dataclass(frozen=True)
    class NanWhenFast(CartPole):
        def observe(self, qpos, qvel):
            obs = super().observe(qpos, qvel)
            with np.errstate(invalid="ignore"):
                obs[:, 3] = np.log(0.15 - np.abs(qvel[:, 0]))  # finite at rest (|v| <= 0.1), NaN once the cart is fast
            return obs

    own_task("broken", NanWhenFast)
    registry.load("broken")  # passes registration
    cfg = TrainConfig(task="broken", iterations=2, num_envs=8, steps_per_env=64, seed=0)
    with pytest.raises(NonFiniteTraining, match=r"iteration 0: .*task 'cartpole': observation term 'cart_vel' is nan "
                                                r"in env \d+ at episode step [1-9]\d*, on a finite physics state"):
        train(cfg, PhysicalParams(), tmp_path)

    @dataclass(frozen=True)
    class NanReward(CartPole):
        def reward(self, qpos, qvel, action):
            return np.where(np.abs(qvel[:, 0]) > 0.15, np.inf, super().reward(qpos, qvel, action))

    own_task("broken", NanReward)
    with pytest.raises(NonFiniteTraining, match=r"iteration 0: .*task 'cartpole': reward\(\) is inf in env \d+ at "
                                                r"episode step [1-9]"):
        train(cfg, PhysicalParams(), tmp_path)


def test_terms_that_say_they_read_a_sensor_must_read_it(own_task):
    """``Term.sensor`` lets calibration compare the logs with the sensor's replayed readings; a wrong label is caught."""
    from stages.sim.quadruped import Quadruped

    terms = Quadruped().observations

    def relabel(sensor_v: str, sensor_w: str, count: int = 3) -> tuple:
        return (*(Term(t.name, t.unit, noise=t.noise, sensor=sensor_v) for t in terms[:count]),
                *(Term(t.name, t.unit, noise=t.noise) for t in terms[count:3]),
                *(Term(t.name, t.unit, noise=t.noise, sensor=sensor_w) for t in terms[3:6]), *terms[6:])

    @dataclass(frozen=True)
    class Swapped(Quadruped):
        observations: tuple = relabel("imu_gyro", "imu_velocity")

    @dataclass(frozen=True)
    class Unknown(Quadruped):
        observations: tuple = relabel("imu_accelerometer", "imu_gyro")

    @dataclass(frozen=True)
    class Partial(Quadruped):
        observations: tuple = relabel("imu_velocity", "imu_gyro", count=2)

    fails(own_task, Swapped, r"observation terms \['base_vx', 'base_vy', 'base_vz'\] say they read sensor 'imu_gyro', "
                             r"but observe\(\) gives other values")
    fails(own_task, Unknown, "term 'base_vx' reads sensor 'imu_accelerometer', which is not in the task's sensors")
    fails(own_task, Partial, "sensor 'imu_velocity' has 3 components but 2 measured observation terms read it")
