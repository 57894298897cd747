"""A device killed in the middle of an episode stops ``sim2edge evaluate --hil`` at once, naming it.

Real agents on loopback (tests/test_hil.py's balancer); one scenario of 250-step (5 s) episodes, so the
remaining episode is far longer than the bound the failure must come within.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.twin.hil import restarted
from stages.twin.hil_link import DeviceLink
from tests.test_hil import SEED, cartpole_store, serve, stop

STEPS, PROBES = 250, 10
BOUND_S = 2.5  # from the kill to the command's exit: 0.5 s of silence and the teardown, not the episode's 5 s


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hil-dead")
    root, _ = cartpole_store(tmp)
    (tmp / "home").mkdir()
    (tmp / "gate.yaml").write_text("max_deadline_miss_fraction: 1\nmax_round_trip_fraction: 100\n")
    return tmp, root


def evaluate(tmp, devices: list[str], episodes: int, out, *options: str):
    args = ["evaluate", "--bundle", str(tmp / "b.tar"), "--trust", str(tmp / "k.pub"), "--episodes", str(episodes),
            "--max-steps", str(STEPS), "--seed", str(SEED), "--out", str(out), "--hil-gate", str(tmp / "gate.yaml"),
            "--scenario", "nominal", *options] + [a for d in devices for a in ("--hil", d)]
    return CliRunner().invoke(app, args, env={"SIM2EDGE_HOME": str(tmp / "home"), "COLUMNS": "220"})


def observations(address: str) -> int:
    link = DeviceLink(address)
    try:
        return (link.stats(timeout_s=0.2, tries=1) or {}).get("observations", 0)
    finally:
        link.close()


def kill_at(proc, address: str, count: int, killed: list[float], timeout_s: float = 60) -> None:
    """SIGKILL the agent once it has answered ``count`` observations (probes included); note when."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and observations(address) < count:
        time.sleep(0.02)
    proc.kill()
    killed.append(time.monotonic())


def run_killing(tmp, devices: list[str], victim, episodes: int, out, *options: str):
    """``evaluate`` while a thread kills ``victim`` (proc, address) 25 steps into its first episode; (result, the
    seconds from the kill to the command's exit)."""
    killed: list[float] = []
    killer = threading.Thread(target=kill_at, args=(*victim, PROBES + 25, killed))
    killer.start()
    try:
        done = evaluate(tmp, devices, episodes, out, *options)
        ended = time.monotonic()
    finally:
        killer.join()
        victim[0].communicate(timeout=10)
    return done, ended - killed[0]


def silent(address: str, periods: int = 25) -> str:
    return (rf"--hil: {re.escape(address)}: scenario 'nominal', episode (\d), step (\d+): no action for {periods} periods "
            rf"\(\d+\.\d\d s\); the device stopped answering$")


def test_a_device_killed_mid_episode_fails_the_run_at_once(store, tmp_path):
    tmp, root = store
    proc, address = serve(root, "udp://127.0.0.1:0")
    done, after_kill = run_killing(tmp, [address], (proc, address), 1, tmp_path / "r.json")
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    m = re.search(silent(address), done.output.strip())
    assert m and m[1] == "0" and 25 <= int(m[2]) < STEPS - 50, done.output
    assert after_kill < BOUND_S, (after_kill, done.output)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()


def test_one_of_two_devices_killed_mid_episode_fails_both_at_once_naming_it(store, tmp_path):
    tmp, root = store
    a_proc, a = serve(root, "udp://127.0.0.1:0")
    b_proc, b = serve(root, "udp://127.0.0.1:0")
    try:
        done, after_kill = run_killing(tmp, [a, b], (b_proc, b), 2, tmp_path / "r.json", "--dead-after", "10")
        assert observations(a) > 0  # the survivor still answers
    finally:
        stop(a_proc)
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    m = re.search(silent(b, 10), done.output.strip())  # the silence limit given on the command line
    assert m and m[1] == "1", done.output  # b ran episode 1; a's own 5 s episode 0 was cut short too
    assert after_kill < BOUND_S, (after_kill, done.output)
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()


def restart_at(proc, address: str, count: int, restarted_at: list, root) -> None:
    """Kill the agent once it has answered ``count`` observations, start a fresh one on the same address; note it
    (the new process, when it began serving)."""
    kill_at(proc, address, count, [])
    proc.communicate(timeout=10)
    fresh, _ = serve(root, address)
    restarted_at.append((fresh, time.monotonic()))


def test_a_device_restarted_mid_episode_fails_the_run_at_its_first_fresh_action(store, tmp_path):
    """A restart quicker than the silence limit (here 200 periods, 4 s) is told by the agent's FRESH actions."""
    tmp, root = store
    proc, address = serve(root, "udp://127.0.0.1:0")
    restarted_at: list = []
    restarter = threading.Thread(target=restart_at, args=(proc, address, PROBES + 25, restarted_at, root))
    restarter.start()
    try:
        done = evaluate(tmp, [address], 1, tmp_path / "r.json", "--dead-after", "200")
        ended = time.monotonic()
    finally:
        restarter.join()
        if restarted_at:
            stop(restarted_at[0][0])
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    m = re.search(rf"--hil: {re.escape(address)}: scenario 'nominal', episode 0, step (\d+): the device restarted "
                  r"\(its first actions again, answering seq \d+ after \d+\.\d\d s\)$", done.output.strip())
    assert m and 25 <= int(m[1]) < STEPS - 50, done.output
    assert ended - restarted_at[0][1] < BOUND_S, done.output  # told at once, not at the scenario's end
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()


def test_a_restarted_device_is_told_by_its_statistics(store):
    tmp, root = store
    proc, address = serve(root, "udp://127.0.0.1:0")
    link = DeviceLink(address)
    try:
        before = link.stats()
        time.sleep(0.2)
        later = link.stats()
        proc.kill()
        proc.communicate(timeout=10)
        proc, _ = serve(root, address)  # the same port, a fresh process
        again = link.stats()
    finally:
        link.close()
        stop(proc)
    assert not restarted(before, later) and restarted(later, again), (before, later, again)
