"""The MuJoCo stand-in robot node (``stages.standin_ros2``) closing the loop with ``sim2edge-agent ros2``.

Two processes over Fast DDS confined to 127.0.0.1 (tests/test_agent_ros2.py's profile): the agent serving a
real signed bundle, and the stand-in stepping cart-pole with its hidden physics (damping ×1.6, gain ×0.85,
pole mass ×1.25, friction, sensor noise of std 0.002). Cart-pole's own contract reads cos/sin of the pole angle,
which a JointState cannot carry, so the task here is cart-pole observed by joint: ``slider``/``hinge``
position and velocity. The policy is the linear balancer of tests/test_evaluate.py on those terms.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.joint_cartpole import JOINT_TERMS
from tests.test_agent_ros2 import AGENT, ros  # noqa: F401 - the fixture

pytestmark = pytest.mark.ros2
TASK = "examples.joint_cartpole:JointCartPole"
BALANCER = (1.0, 10.0, 1.0, 1.5)
"""tests/test_evaluate.py's BALANCER (cart, pole sin, cart vel, pole rate) with the pole angle for its sine."""
EPISODES, SEED = 10, 100
IO = {"input": {"terms": [{"name": n, "unit": "1"} for n in JOINT_TERMS]},
      "output": {"terms": [{"name": "slide", "unit": "N"}], "low": [-1.0], "high": [1.0], "default": [0.0]}}


def balancer_store(tmp_path: Path) -> tuple[Path, Path]:
    """(device store with the balancer bundle active, its ONNX file)."""
    from edge import bundle, signing
    from edge.store import DeviceStore
    from tests.bundles import linear_onnx, make_bundle, make_keys

    onnx = tmp_path / "policy.onnx"
    onnx.write_bytes(linear_onnx(np.asarray(BALANCER, np.float32).reshape(4, 1)))
    x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    golden = tmp_path / "golden.npz"
    np.savez(golden, inputs=x, outputs=np.clip(x @ np.asarray(BALANCER, np.float32).reshape(4, 1), -1, 1))
    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv, files={"policy.onnx": onnx.read_bytes(), "golden.npz": golden.read_bytes()},
                io=IO, period_s=0.02, name="balancer")
    store = DeviceStore(tmp_path / "store")
    staged = store.staging_dir()
    bundle.extract(tmp_path / "b.tar", staged, 1 << 24)
    bundle.verify_dir(staged, signing.load_trusted([pub]))
    store.activate(store.install(staged, "balancer", "1"))
    return store.root, onnx


def in_process(onnx: Path) -> tuple[list[bool], list[float]]:
    """Per-episode (success, return) of the same policy on the stand-in's physics and seeds, in-process."""
    from edge.runtime import OnnxRuntime
    from stages.sim.env import BatchedEnv
    from stages.sim.registry import load
    from stages.standin import hidden_params
    from stages.twin.episodes import run_episodes

    task, policy = load(TASK), OnnxRuntime(onnx)
    runs = [run_episodes(policy, BatchedEnv(task, 1, hidden_params(task.name), seed=SEED + k)) for k in range(EPISODES)]
    return [bool(r.success[0]) for r in runs], [float(r.returns[0]) for r in runs]


def test_mujoco_standin_closes_the_loop_with_the_agent_as_in_process(tmp_path, ros):  # noqa: F811
    """The stand-in's episodes through the agent end as in-process evaluation's of the same seeds: the same initial
    states and physics, each state answered before the physics steps; only the sensor noise is drawn apart
    and a loaded host may answer a few states late (the stand-in then applies the previous action). So: at most
    one episode's outcome may differ (the dropped episodes fall far below the success return of 60, the kept ones
    stay above 70), and the mean return within 5% (measured: 0.1%)."""
    root, onnx = balancer_store(tmp_path)
    agent = subprocess.Popen([AGENT, "ros2", "--root", str(root), "--action-type", "joint_trajectory"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ros)
    try:
        assert agent.stdout.readline().startswith("serving balancer v1 on ROS 2"), agent.stderr.read()
        robot = subprocess.run([sys.executable, "-m", "stages.standin_ros2", "--task", TASK, "--episodes",
                                str(EPISODES), "--seed", str(SEED), "--out", str(tmp_path / "robot.json")],
                               capture_output=True, text=True, env=ros, timeout=120, cwd=Path(__file__).parent.parent)
        assert robot.returncode == 0 and robot.stdout.startswith("done"), robot.stdout + robot.stderr
    finally:
        agent.terminate()
        out, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    got = json.loads((tmp_path / "robot.json").read_text())
    assert got["robot"] == "stand-in:cartpole" and [e["seed"] for e in got["episodes"]] == list(range(SEED, SEED + EPISODES))
    success, returns = in_process(onnx)
    assert 0 < sum(success) < EPISODES  # the comparison means something: the balancer drops some episodes
    ros_success = [e["success"] for e in got["episodes"]]
    assert sum(a != b for a, b in zip(ros_success, success)) <= 1, (ros_success, success)
    assert np.mean([e["return"] for e in got["episodes"]]) == pytest.approx(np.mean(returns), rel=0.05)
    steps = sum(e["steps"] for e in got["episodes"])
    assert sum(e["late"] for e in got["episodes"]) <= 0.1 * steps, got  # ≈ 0; slack for a loaded host
    assert stats["observations"] >= steps and stats["malformed"] == 0 and stats["safe_default"] == 0, stats


MAPPING = {"joint_state": {"topic": "/joint_states", "stamp": "header", "max_age_s": 0.1},
           "commands": {"topic": "/sim2edge/action", "type": "std_msgs/msg/Float64MultiArray", "names": ["slide"],
                        "max_age_s": 0.1},
           "episodes": {"gap_s": 0.5}, "policy_version": "balancer-1"}
"""The stand-in's bag as ``stages.collect`` reads it: joint states, and the agent's actions as the commands (stale
after 5 periods, the agent's watchdog horizon: a loaded host wakes a period or two late)."""


def test_standin_bag_reads_back_through_collect(tmp_path, ros):  # noqa: F811
    """With ``--bag`` the stand-in records the wire's bytes (``Float64MultiArray`` actions this time); ``collect``
    splits the episodes at the gaps, and each row's command is the balancer's answer to that row's joint state (the
    stand-in starts each episode half a period after an agent tick, so the collector's tick grid falls between
    states and answers)."""
    from stages import logs
    from stages.collect.bag_mapping import BagMapping
    from stages.collect.ingest import ingest_bag
    from stages.collect.store import DatasetStore, dataset_files
    from stages.sim.registry import load

    root, _ = balancer_store(tmp_path)
    agent = subprocess.Popen([AGENT, "ros2", "--root", str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ros)
    try:
        assert agent.stdout.readline().startswith("serving balancer v1 on ROS 2"), agent.stderr.read()
        robot = subprocess.run([sys.executable, "-m", "stages.standin_ros2", "--task", TASK, "--episodes", "3",
                                "--seed", str(SEED), "--action-type", "float64_array", "--bag", str(tmp_path / "bag"),
                                "--gap", "0.7", "--out", str(tmp_path / "robot.json")], capture_output=True, text=True,
                               env=ros, timeout=120, cwd=Path(__file__).parent.parent)
        assert robot.returncode == 0 and robot.stdout.startswith("done"), robot.stdout + robot.stderr
    finally:
        agent.terminate()
        agent.communicate(timeout=20)
    episodes = json.loads((tmp_path / "robot.json").read_text())["episodes"]
    report = ingest_bag(DatasetStore(tmp_path / "datasets", load(TASK), TASK), tmp_path / "bag",
                        BagMapping.model_validate(MAPPING))
    assert report.quarantined == () and report.dataset.episodes == 3, report
    (path,) = dataset_files(report.dataset)
    table = logs.read(path)
    episode = table.column("episode").to_numpy()
    ticks = [int((episode == e).sum()) for e in np.unique(episode)]
    for n, e in zip(ticks, episodes):  # wall-clock ticks: a late answer (a loaded host) stretches an episode
        assert e["steps"] - 1 <= n <= 1.1 * e["steps"] + 1, (ticks, episodes)
    qpos, qvel, ctrl = (logs.columns(table, c) for c in ("qpos", "qvel", "ctrl"))
    answer = np.clip(np.concatenate([qpos, qvel], axis=1) @ np.asarray(BALANCER), -1, 1)
    same = np.abs(ctrl[:, 0] - answer) < 1e-4
    assert same.mean() >= 0.8, same.mean()  # measured: 1.0 at load 3-5, 0.85 at load 7 (late wake-ups)
