"""The README's bring-your-own-robot example, end to end through the stages."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from edge.runtime import OnnxRuntime
from flows.params import SimToEdgeParams
from stages.export import ExportConfig, export
from stages.sim.env import BatchedEnv
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.train import train
from stages.train_config import TrainConfig
from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[1]

TASK = "examples.pendulum:Pendulum"


def test_own_task_loads_steps_trains_and_exports(tmp_path):
    task = load(TASK)
    assert task.name == "pendulum" and task.obs_dim == 3
    env = BatchedEnv(task, 4, randomization=task.randomization, seed=0)
    r = env.step(np.zeros((4, 1)))
    assert r.obs.shape == (4, 3) and np.all(np.isfinite(r.obs))
    ckpt = train(TrainConfig(task=TASK, iterations=2, num_envs=8, steps_per_env=8, hidden_dims=(16,)),
                 PhysicalParams(), tmp_path / "ck")
    policy = export(ExportConfig(parity_samples=100), ckpt, tmp_path / "onnx")
    assert OnnxRuntime(policy.path).run(np.zeros((2, 3), np.float32)).shape == (2, 1)


def test_flow_parameters_accept_the_own_task_and_refuse_a_broken_path():
    assert SimToEdgeParams(task=TASK).task == TASK
    try:
        SimToEdgeParams(task="examples.pendulum:NoSuchTask")
    except ValueError as e:
        assert "task" in str(e)
    else:
        raise AssertionError("an unknown class must be refused")


@pytest.mark.slow
def test_sim2edge_run_with_own_task_from_the_cli(tmp_path):
    """The README's command, on the embedded defaults (local Prefect API, SQLite MLflow), tiny budget."""
    r = run_cli("sim2edge", "run", "--task", TASK, "--iterations", "2", "--eval-episodes", "4", cwd=REPO,
                env={"SIM2EDGE_HOME": str(tmp_path)}, unset=("MLFLOW_TRACKING_URI", "PREFECT_API_URL"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "model version" in r.stdout and "sim2edge-agent pull pendulum@" in r.stdout
    assert (tmp_path / "mlflow" / "mlflow.db").exists() and (tmp_path / "keys" / "signing.pub").exists()
    bundles = list((tmp_path / "runs").glob("*/bundle/bundle.tar"))
    assert len(bundles) == 1
    # the registered version records its task (module:Class and source digest): evaluate finds it without an
    # entry point, although the model is named after Task.name
    ref = re.search(r"sim2edge-agent pull (pendulum@\w+)", r.stdout).group(1)
    ev = run_cli("sim2edge", "evaluate", ref, "--episodes", "2", "--no-video", cwd=REPO,
                 env={"SIM2EDGE_HOME": str(tmp_path)}, unset=("MLFLOW_TRACKING_URI", "PREFECT_API_URL"))
    assert ev.returncode in (0, 1) and ("PASSED;" in ev.stdout or "FAILED;" in ev.stdout), ev.stdout + ev.stderr
    assert "unknown task" not in ev.stdout + ev.stderr and "warning" not in ev.stdout


def test_a_task_from_an_entry_point_is_registered(tmp_path, monkeypatch):
    from stages.sim import registry

    dist = tmp_path / "my_robots-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-robots\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sim2edge.tasks]\nmy-pendulum = examples.pendulum:Pendulum\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "my-pendulum" in registry.names()
    assert registry.load("my-pendulum").name == "pendulum"
