"""Run configurations: a task's preset, a YAML file, --set and command-line options, in that order; mistakes named
in one line; a wall-clock training budget."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from flows.params import SimToEdgeParams, TrainSettings
from flows.run_config import RunConfigError, resolve
from stages.sim.params import PhysicalParams, Randomization
from stages.sim.registry import load
from stages.rsl_env import make_env
from stages.train import train
from stages.train_config import TrainConfig
from stages.twin.stats import wilson
from tests.conftest import run_cli


def test_each_task_has_a_preset_that_validates():
    for name in ("cartpole", "reacher", "arm6", "quadruped"):
        assert load(name).preset_path is not None
        assert resolve(name, None, [], {}).task == name
    quad = resolve("quadruped", None, [], {})
    assert quad.train.hidden_dims == (256, 128, 64) and quad.train.minutes == 20 and quad.num_envs == 256
    assert resolve("cartpole", None, [], {}) == SimToEdgeParams()  # the defaults are cart-pole's


def test_layers_apply_in_order_preset_file_set_options(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: arm6\niterations: 50\ntrain:\n  learning_rate: 3.0e-4\n  minutes: 5\n")
    p = resolve(None, cfg, ["train.learning_rate=1e-4", "gate.min_success_rate=0.9"], {"iterations": 7, "seed": None})
    assert p.task == "arm6" and p.iterations == 7 and p.train.learning_rate == 1e-4 and p.gate.min_success_rate == 0.9
    assert p.train.minutes == 5 and p.train.hidden_dims == (128, 128) and p.num_envs == 128  # from the arm6 preset
    assert resolve("reacher", cfg, [], {}).task == "reacher"  # --task beats the file's task
    assert resolve("reacher", cfg, [], {}).train.gamma == 0.9  # and brings its own preset


def test_a_sensor_in_the_file_is_checked_against_the_task_the_command_line_names(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("calibrate:\n  sensors: {imu_gyro: 0.05}\n")  # no task in the file: cartpole reads no IMU
    assert resolve("quadruped", cfg, [], {}).calibrate.sensors == {"imu_gyro": 0.05}


@pytest.mark.parametrize("text,sets,message", [
    ("train:\n  learnin_rate: 1\n", [], r"run.yaml: train.learnin_rate: not a key here; allowed: steps_per_env, "
                                        r"hidden_dims, learning_rate, entropy_coef, gamma, gae_lambda, init_noise_std, "
                                        r"desired_kl, collector, collector_processes, minutes, randomization, "
                                        r"disturbance$"),
    ("train:\n  collector_processes: 3\n", [], r"run.yaml: train.collector_processes: 3 needs train.collector "
                                               r"'process' and must divide num_envs 128 \(got collector 'sequential'\)$"),
    ("iterations: 0\n", [], r"run.yaml: iterations: Input should be greater than or equal to 1 \(got 0\)$"),
    ("target: orin-nano\n", [], r"run.yaml: target: .*orin-nano"),
    ("- a\n- b\n", [], r"run.yaml: a run configuration is a mapping of keys, got list$"),
    ("a: [\n", [], r"run.yaml: cannot read it as YAML"),
    ("", ["train.gamma=2"], r"--set train.gamma=2: train.gamma: Input should be less than or equal to 1 \(got 2\)$"),
    ("", ["learning_rate"], r"--set 'learning_rate': write KEY=VALUE"),
    ("task: nosuch\n", [], r"task: unknown task 'nosuch'; valid tasks: arm6, cartpole, quadruped, reacher"),
    ("task: quadruped\ncalibrate:\n  sensors: {imu_gyro: 0.05, imu_gyr: 0.05}\n", [],
     r"run.yaml: calibrate.sensors: task 'quadruped' has no observation terms that read sensor 'imu_gyr' "
     r"\(Term.sensor\); these do: \['imu_gyro', 'imu_velocity'\]$"),
    ("calibrate:\n  sensors: {imu_gyro: 0.05}\n", [], r"run.yaml: calibrate.sensors: task 'cartpole' has no "
                                                       r"observation terms that read sensor 'imu_gyro'.*none$"),
])
def test_a_mistake_is_one_line_naming_the_file_and_key(tmp_path, text, sets, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    with pytest.raises(RunConfigError, match=message):
        resolve(None, cfg, sets, {})


def test_the_cli_refuses_a_bad_config_in_one_line_before_starting_anything(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  hidden_dims: []\n")
    r = run_cli("sim2edge", "run", "--config", str(cfg), env={"SIM2EDGE_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.strip().splitlines() == [f"error: --config {cfg}: train.hidden_dims: Tuple should have at least 1 "
                                             f"item after validation, not 0 (got [])"]
    assert not (tmp_path / "home").exists()


def test_a_training_budget_in_minutes_stops_training(tmp_path):
    budget_s, ends = 4.0, []
    ckpt = train(TrainConfig(iterations=100_000, num_envs=16, steps_per_env=8, minutes=budget_s / 60), PhysicalParams(),
                 tmp_path / "ckpt", on_iteration=lambda it, m: ends.append(time.perf_counter()))
    assert 1 < ckpt.iterations == len(ends) < 100_000
    longest = max(b - a for a, b in zip(ends, ends[1:]))
    assert ends[-1] - ends[0] <= budget_s + longest  # stopped at the budget (its clock starts before iteration 1)


def test_train_settings_reach_the_training_config():
    settings = TrainSettings(learning_rate=2e-4, hidden_dims=(32,), minutes=1)
    cfg = TrainConfig(task="cartpole", **settings.model_dump())
    assert cfg.learning_rate == 2e-4 and cfg.hidden_dims == (32,) and cfg.minutes == 1
    assert set(TrainSettings.model_fields) <= set(TrainConfig.model_fields)


def test_randomization_set_in_a_run_configuration_trains_over_it_keeping_the_tasks_other_ranges():
    task = load("arm6")
    p = resolve("arm6", None, ["train.randomization.latency_steps=2", "train.randomization.damping=0.3"], {})
    assert p.train.randomization.latency_steps == 2 and p.train.randomization.damping == 0.3
    assert p.train.randomization.mass == task.randomization.mass != Randomization().mass  # the task's, not a default
    cfg = TrainConfig(task="arm6", num_envs=32, **p.train.model_dump())
    twin = PhysicalParams(latency_steps=1)
    assert set(make_env(cfg, task, twin).latency) == {1, 2, 3}  # the twin's delay plus 0, 1 or 2 steps
    assert set(make_env(cfg.model_copy(update={"randomization": None}), task, twin).latency) == {1}  # the task's


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOT_RUN_CONFIGS = {"rosbag_mapping.yaml"}  # a topic mapping for `sim2edge collect --source rosbag`


def leaves(data: dict, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """Every (key path, value) of a nested mapping."""
    out = []
    for k, v in data.items():
        out += leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)]
    return out


@pytest.mark.parametrize("path", sorted(p for p in EXAMPLES.glob("*.yaml") if p.name not in NOT_RUN_CONFIGS),
                         ids=lambda p: p.name)
def test_each_example_run_configuration_resolves_through_the_loader(path):
    text = path.read_text()
    assert f"sim2edge run --config examples/{path.name}" in text.splitlines()[0]  # it says its own command
    p = resolve(None, path, [], {})
    data = yaml.safe_load(text)
    assert p.task == data["task"] and load(p.task).name == data["task"]
    resolved = p.model_dump()
    for keys, value in leaves(data):  # every key the file sets reaches the parameters unchanged
        got = resolved
        for k in keys:
            got = got[k]
        assert got == (tuple(value) if isinstance(value, list) else value), keys


def test_the_example_run_configurations_carry_what_made_each_task_learn():
    assert {p.name for p in EXAMPLES.glob("*.yaml")} >= {"run.yaml", "arm6.yaml", "quadruped.yaml"}
    p = resolve(None, EXAMPLES / "run.yaml", [], {})
    assert p.task == "cartpole" and p.iterations == 120 and p.train.hidden_dims == (64, 64)
    arm6 = resolve(None, EXAMPLES / "arm6.yaml", [], {})
    assert (arm6.iterations, arm6.num_envs, arm6.train.hidden_dims) == (3000, 128, (128, 128))
    assert arm6.eval_episodes == 64  # the nominal floor is the 90%: 58/64 (91%) passes it, 57/64 (89%) not
    assert wilson(57, 64)[0] < arm6.gate.min_success_rate <= wilson(58, 64)[0]
    quad = resolve(None, EXAMPLES / "quadruped.yaml", ["train.minutes=20"], {})
    assert quad.train.minutes == 20 and quad.train.hidden_dims == (256, 128, 64) and quad.num_envs == 256
    assert quad.eval_episodes == 64  # a fall fails an episode: 3/64 falls (4.7%) pass the nominal floor, 4/64 not
    assert wilson(60, 64)[0] < quad.gate.min_success_rate <= wilson(61, 64)[0]
