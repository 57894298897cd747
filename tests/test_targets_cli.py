"""Target profiles, device detection, and one subprocess smoke test per CLI command."""

from __future__ import annotations

import json

import pytest

from edge.errors import CheckFailed
from edge.targets import PROFILES, DeviceInfo, check_compatible, detect_device, load_target, parse_l4t
from tests.conftest import run_cli


def test_profiles_cover_the_jetpack_matrix():
    assert set(PROFILES) == {"orin-jp5.1", "xavier-jp5.1", "orin-jp6.0", "orin-jp6.1", "orin-jp6.2", "thor-jp7.0"}
    assert load_target("orin-jp6.1").tensorrt == "10.3"
    with pytest.raises(KeyError, match="valid targets: orin-jp5.1"):
        load_target("nano-jp4")


@pytest.mark.parametrize("text,expected", [
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8", (36, 4, 3)),
    ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64", (35, 4, 1)),
    ("36.4.0", (36, 4, 0)),
])
def test_parse_l4t(text, expected):
    assert parse_l4t(text) == expected


def test_detect_device_reads_the_release_file_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("L4T_VERSION", raising=False)
    release = tmp_path / "nv_tegra_release"
    release.write_text("# R36 (release), REVISION: 4.0, GCID: 1, BOARD: generic, EABI: aarch64\n")
    assert detect_device(release).l4t == (36, 4, 0)
    monkeypatch.setenv("L4T_VERSION", "35.6.0")
    assert detect_device(release).l4t == (35, 6, 0)


@pytest.mark.parametrize("target,l4t,arch,ok", [
    ("orin-jp6.1", (36, 4, 0), "aarch64", True),
    ("orin-jp6.1", (36, 4, 3), "aarch64", False),
    ("orin-jp6.2", (36, 4, 3), "aarch64", True),
    ("orin-jp5.1", (36, 4, 0), "aarch64", False),
    ("orin-jp6.1", (36, 4, 0), "x86_64", False),
    ("orin-jp6.1", None, "x86_64", False),
])
def test_check_compatible(target, l4t, arch, ok):
    device = DeviceInfo(l4t, arch, "3.10", "test")
    if ok:
        check_compatible(load_target(target), device)
    else:
        with pytest.raises(CheckFailed, match=r"^target: bundle is for "):
            check_compatible(load_target(target), device)


def test_cli_tasks_and_targets():
    tasks = run_cli("sim2edge", "tasks")
    assert tasks.returncode == 0 and "cartpole" in tasks.stdout
    targets = run_cli("sim2edge", "targets", "--json")
    assert targets.returncode == 0 and set(json.loads(targets.stdout)) == set(PROFILES)


def test_cli_run_refuses_unknown_task_and_target(tmp_path):
    r = run_cli("sim2edge", "run", "--task", "walker", "--target", "nano", env={"SIM2EDGE_HOME": str(tmp_path)})
    assert r.returncode == 2
    assert "valid tasks: " in r.stdout and "cartpole" in r.stdout and "valid targets:" in r.stdout


def test_agent_cli_help_and_status_on_empty_store(tmp_path):
    assert run_cli("sim2edge-agent", "--help").returncode == 0
    r = run_cli("sim2edge-agent", "status", "--root", str(tmp_path))
    assert r.returncode == 1 and "no active policy" in r.stdout
