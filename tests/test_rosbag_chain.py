"""Issue 20's chain: a bag written as a ROS 2 robot writes it → collect → calibrate → train → evaluate → package, and
the packaged policy drives the stand-in robot node through ``sim2edge-agent ros2``.

The robot is the MuJoCo stand-in node (``python -m stages.standin_ros2``: cart-pole with its hidden physics) on the
joint-only cart-pole task (examples/joint_cartpole.py), over Fast DDS confined to loopback (tests/test_agent_ros2.py's
profile). The exploring controller that writes the bag is the linear balancer of tests/test_standin_ros2.py, which
drops some episodes (the pole starts up to 0.5 rad off): falls and recoveries both land in the logs. Everything after
the bag is the product's commands: ``sim2edge collect --source rosbag``, ``sim2edge run --dataset-version 1`` (the
embedded defaults: local Prefect, SQLite MLflow), the bundle from the run installed in a device store as ``pull``
installs it, then ``sim2edge-agent ros2`` serving it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import run_cli
from tests.test_agent_ros2 import AGENT, ros  # noqa: F401 - the fixture
from tests.test_standin_ros2 import MAPPING, SEED, TASK, balancer_store

REPO = Path(__file__).resolve().parents[1]
UNSET = ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")
BAG_EPISODES = 8
DRIVE_EPISODES, DRIVE_SEED = 10, 500
BUDGET = {"iterations": 100, "num_envs": 64, "eval_episodes": 8,
          "train": {"steps_per_env": 32, "hidden_dims": [64, 64], "disturbance": {"init_spread": 1.0}},
          "calibrate": {"max_windows": 16, "generations": 8, "search_generations": 2, "max_latency": 1,
                        "joint_steps": 0, "bootstrap": 20}}
"""The smallest budget that learns joint cart-pole on the twin (cart-pole learns in 30–60 iterations)."""


def drive(root: Path, env: dict, tmp_path: Path, name: str, episodes: int, seed: int, *robot_args: str) -> dict:
    """The agent serving ``root``'s active bundle against the stand-in node for ``episodes`` episodes
    (``Float64MultiArray`` actions, as the bag's mapping reads them); the stand-in's result (``{robot, episodes: [...]}``) and the agent's closing stats."""
    agent = subprocess.Popen([AGENT, "ros2", "--root", str(root), "--action-type", "float64_array"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = agent.stdout.readline()
        assert line.startswith("serving "), line + agent.stderr.read()
        robot = subprocess.run([sys.executable, "-m", "stages.standin_ros2", "--task", TASK, "--episodes", str(episodes),
                                "--seed", str(seed), "--action-type", "float64_array", "--out",
                                str(tmp_path / f"{name}.json"), *robot_args],
                               capture_output=True, text=True, env=env, timeout=180, cwd=REPO)
        assert robot.returncode == 0 and robot.stdout.startswith("done"), robot.stdout + robot.stderr
    finally:
        agent.terminate()
        out, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err
    return {**json.loads((tmp_path / f"{name}.json").read_text()), "agent": json.loads(out.strip().splitlines()[-1])}


def install(bundle_tar: Path, trusted: Path, root: Path, version: str) -> None:
    """The bundle verified against the workspace's key and made active, as ``sim2edge-agent pull`` installs it."""
    from edge import bundle, signing
    from edge.store import DeviceStore

    store = DeviceStore(root)
    staged = store.staging_dir()
    bundle.extract(bundle_tar, staged, 1 << 26)
    bundle.verify_dir(staged, signing.load_trusted([trusted]))
    store.activate(store.install(staged, "cartpole", version))


def test_run_refuses_a_dataset_version_that_is_not_there(tmp_path):
    r = run_cli("sim2edge", "run", "--task", TASK, "--dataset-version", "3", cwd=REPO,
                env={"SIM2EDGE_HOME": str(tmp_path)}, unset=UNSET)
    assert r.returncode == 2 and "--dataset-version: no dataset version 'v0003'" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.ros2
def test_a_robots_bag_goes_through_the_chain_and_its_policy_drives_the_robot(tmp_path, ros):
    """Tolerance: through ROS the packaged policy succeeds on at least 7 of the 10 stand-in episodes, and within one
    episode of in-process evaluation of the same bundle on the same seeds and hidden physics. The task's starts (pole
    up to 0.5 rad off, success at return 60) cap what a controller can do: over 200 in-process episodes on the
    hidden physics the trained policy succeeded on 72.5%, the linear balancer on 71%; measured here: 8 of 10 through
    ROS and in-process alike, in two runs. The fitted values are reported, not asserted: on a loaded host the
    stand-in's lockstep physics waits for late answers and the bag's episodes stretch, which the fit reads as a
    later, weaker actuator (docs/data-and-twin.md has both runs). (Evaluation's gate, on 8 episodes per scenario, cannot pass its 95% lower bounds:
    the version is registered a challenger, and installed as the bundle file regardless.)"""
    from mlflow.tracking import MlflowClient

    from edge.runtime import OnnxRuntime
    from stages.sim.env import BatchedEnv
    from stages.sim.registry import load
    from stages.standin import hidden_params
    from stages.twin.episodes import run_episodes

    figures, started = {}, time.perf_counter()
    home, cli_env = tmp_path / "home", {"SIM2EDGE_HOME": str(tmp_path / "home")}
    # (1) the robot writes a bag while an exploring controller drives it through the agent
    (tmp_path / "explorer").mkdir()
    explorer, _ = balancer_store(tmp_path / "explorer")
    recorded = drive(explorer, ros, tmp_path, "explore", BAG_EPISODES, SEED, "--bag", str(tmp_path / "bag"),
                     "--gap", "0.7")
    figures["explorer_success"] = sum(e["success"] for e in recorded["episodes"])
    # (2) collect ingests it
    mapping = tmp_path / "robot.yaml"
    mapping.write_text(yaml.safe_dump(MAPPING))
    r = run_cli("sim2edge", "collect", "--task", TASK, "--source", "rosbag", "--bag", str(tmp_path / "bag"),
                "--mapping", str(mapping), cwd=REPO, env=cli_env, unset=UNSET)
    assert r.returncode == 0, r.stdout + r.stderr
    kept = re.search(rf"dataset {re.escape(TASK)} v0001 \(new\): (\d+) episodes, (\d+) rows", r.stdout)
    # measured: all 8 kept; a host stalling > 0.1 s (5 periods) mid-episode quarantines that episode as stale
    assert kept and int(kept.group(1)) >= BAG_EPISODES - 2, r.stdout
    figures["dataset"] = {"episodes": int(kept.group(1)), "rows": int(kept.group(2))}
    # (3) calibrate → train → export → evaluate → package → register from that dataset version
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(BUDGET))
    r = run_cli("sim2edge", "run", "--task", TASK, "--dataset-version", "1", "--config", str(config), cwd=REPO,
                env=cli_env, unset=UNSET)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = [p for p in (home / "runs").iterdir() if (p / "bundle" / "bundle.tar").exists()]
    assert not (home / "datasets" / "cartpole" / "versions" / "v0002").exists()  # no fresh stand-in logs
    client = MlflowClient(f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    parent = client.get_run(run_dir.name)
    assert parent.data.tags["sim2edge.dataset_version"] == "v0001"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_dir.name}'")
    assert "collect" not in {c.info.run_name for c in children}
    train_run = next(c for c in children if c.info.run_name == "train")
    twin = json.loads((run_dir / "twin" / "twin.json").read_text())
    hidden = hidden_params("cartpole")
    figures["calibration"] = {k: {"fitted": round(float(twin["params"][k]), 3), "hidden": getattr(hidden, k)}
                              for k in ("damping", "actuator_gain", "mass", "friction", "latency_steps", "obs_noise")
                              if k in twin["params"]}
    figures["replay_error"] = (round(twin["replay_error_before"], 4), round(twin["replay_error_after"], 4))
    figures["train_final_return"] = round(train_run.data.metrics["mean_return"], 1)
    figures["eval_success_rate"] = parent.data.metrics["success_rate"]
    figures["eval_mean_return"] = round(parent.data.metrics["mean_return"], 1)
    figures["gate"] = parent.data.tags["sim2edge.alias"]
    figures["stage_seconds"] = {k.split(".", 1)[1]: round(v) for k, v in parent.data.metrics.items()
                                if k.startswith("seconds.")}
    print("pipeline figures", json.dumps(figures))
    print("figures", json.dumps(figures))
    assert twin["replay_error_after"] < twin["replay_error_before"]
    # (4) the packaged bundle, installed on the device, drives the robot through ROS 2
    version = parent.data.tags["sim2edge.model_version"]
    root = tmp_path / "device"
    install(run_dir / "bundle" / "bundle.tar", home / "keys" / "signing.pub", root, version)
    got = drive(root, ros, tmp_path, "drive", DRIVE_EPISODES, DRIVE_SEED)
    ros_success = [e["success"] for e in got["episodes"]]
    task, policy = load(TASK), OnnxRuntime(root / "current" / "policy.onnx")
    runs = [run_episodes(policy, BatchedEnv(task, 1, hidden, seed=DRIVE_SEED + k)) for k in range(DRIVE_EPISODES)]
    here = [bool(x.success[0]) for x in runs]
    figures.update(ros_success=sum(ros_success), in_process_success_on_hidden=sum(here),
                   ros_mean_return=round(float(np.mean([e["return"] for e in got["episodes"]])), 1),
                   late=sum(e["late"] for e in got["episodes"]), seconds=round(time.perf_counter() - started))
    print("figures", json.dumps(figures))
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    assert sum(ros_success) >= 7, figures
    assert sum(a != b for a, b in zip(ros_success, here)) <= 1, (ros_success, here)
    assert got["agent"]["malformed"] == 0 and got["agent"]["safe_default"] == 0, got["agent"]
