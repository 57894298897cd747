"""``--hil ros2://``: the twin in real time as the robot of a real ``sim2edge-agent ros2``, over Fast DDS confined to
127.0.0.1 (tests/test_agent_ros2.py's profile, here also in the evaluating process).

The bundle is tests/test_standin_ros2.py's linear balancer of cart-pole observed by joint (a JointState can carry
only joint terms); the HIL episodes and in-process evaluation run on the same seeds and twin.
"""

from __future__ import annotations

import subprocess

import pytest

from stages.twin.hil_evaluate import HilGateConfig, HilSuiteConfig, check_devices, hil_evaluate
from stages.twin.hil_link import DeviceFailed
from tests.test_agent_ros2 import AGENT, ros  # noqa: F401 - the fixture
from tests.test_standin_ros2 import TASK, balancer_store

pytestmark = pytest.mark.ros2
SEED, EPISODES, STEPS = 100, 4, 100
LOADED = HilGateConfig(max_deadline_miss_fraction=0.1, max_round_trip_fraction=2.0)
"""Measured at load 5: 1 miss in 338 periods, round trip p99 13 ms; at load 7 p99 reached 20 ms (the period)."""


def in_this_process(monkeypatch, env: dict) -> None:
    """The ROS settings of the test's processes (loopback profile, domain, log folders) for this one too."""
    for key in ("RMW_IMPLEMENTATION", "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_HOME", "ROS_LOG_DIR", "ROS_DOMAIN_ID",
                "ROS_AUTOMATIC_DISCOVERY_RANGE"):
        monkeypatch.setenv(key, env[key])


def suite(device: str = "ros2://") -> HilSuiteConfig:
    return HilSuiteConfig(devices=(device,), episodes=EPISODES, seed=SEED, max_steps=STEPS, scenarios=("nominal",))


def test_hil_over_ros2_drives_the_agent_as_in_process(tmp_path, ros, monkeypatch):  # noqa: F811
    in_this_process(monkeypatch, ros)
    root, onnx = balancer_store(tmp_path)
    agent = subprocess.Popen([AGENT, "ros2", "--root", str(root), "--action-type", "joint_trajectory",
                              "--watchdog-periods", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ros)
    try:
        assert agent.stdout.readline().startswith("serving balancer v1 on ROS 2"), agent.stderr.read()
        report = hil_evaluate(suite(), LOADED, onnx, TASK)
    finally:
        agent.terminate()
        out, err = agent.communicate(timeout=20)
    assert agent.returncode == 0, err
    (row,) = report.scenarios
    base, hil = row["in_process"], row["hil"]
    assert 0 < base["success_rate"] < 1  # the balancer drops some of these starts: the comparison means something
    assert hil["episodes"] == EPISODES and hil["success_rate"] == base["success_rate"], (hil, base)
    assert hil["mean_return"] == pytest.approx(base["mean_return"], rel=0.05)
    assert hil["deadline_misses"] <= 0.1 * hil["steps"], hil  # measured 1 of 338 at load 5; more on a busier host
    assert report.round_trip_ms_p99 < 40 and report.passed, report.checks
    assert row["device"] is None and report.device_runtime is None  # no statistics request over ROS 2


def test_ros2_addresses_are_checked_and_a_missing_agent_is_named(tmp_path, ros, monkeypatch):  # noqa: F811
    in_this_process(monkeypatch, ros)
    with pytest.raises(ValueError, match=r"device address 'ros2://robot' must be ros2:// with optional state="):
        check_devices(("ros2://robot",))
    with pytest.raises(ValueError, match=r"topic 'joint_states' must start with /"):
        check_devices(("ros2://?state=joint_states",))
    assert check_devices(("ros2://?state=/arm/joint_states", "ros2://")) == ("ros2://?state=/arm/joint_states", "ros2://")
    _, onnx = balancer_store(tmp_path)
    with pytest.raises(DeviceFailed, match=r"^ros2://: no agent subscribes to /joint_states and publishes on "
                                           r"/sim2edge/action .* within 10 s$"):
        hil_evaluate(suite(), HilGateConfig(), onnx, TASK)
