"""``sim2edge evaluate --hil A --hil B``: the suite sharded across two real agents serving the same signed bundle,
against the same suite on one of them.

tests/test_hil.py's linear cart-pole balancer; 3 scenarios × 2 episodes of 40 steps (0.8 s) each, so that the
two devices' parts (3 episodes each) split one scenario between them.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.run_config import resolve
from stages.twin.hil_link import DeviceLink
from stages.twin.hil import hil_task
from stages.twin.hil_evaluate import shards
from stages.twin.hil_stage import HilSettings, bundled_graph, hil_metrics, run_hil_stage
from tests.test_hil import SEED, cartpole_store, serve, stop

STEPS, EPISODES = 40, 2
SCENARIOS = ("nominal", "damping+30%", "gain-15%")  # in suite order


@pytest.fixture(scope="module")
def devices(tmp_path_factory):
    """(workspace dir, two addresses): two agents on loopback serving one store's bundle."""
    tmp = tmp_path_factory.mktemp("hil-shards")
    root, _ = cartpole_store(tmp)
    (tmp / "home").mkdir()
    # the link's floors out of the way: what is checked is the sharding, on a host that may be busy
    (tmp / "gate.yaml").write_text("max_deadline_miss_fraction: 1\nmax_round_trip_fraction: 100\n")
    procs = [serve(root, "udp://127.0.0.1:0") for _ in range(2)]
    yield tmp, [address for _, address in procs]
    for proc, _ in procs:
        stop(proc)


def evaluate(tmp, devices: list[str], out):
    args = ["evaluate", "--bundle", str(tmp / "b.tar"), "--trust", str(tmp / "k.pub"), "--episodes", str(EPISODES),
            "--max-steps", str(STEPS), "--seed", str(SEED), "--out", str(out), "--hil-gate", str(tmp / "gate.yaml")]
    args += [a for d in devices for a in ("--hil", d)] + [a for s in SCENARIOS for a in ("--scenario", s)]
    return CliRunner().invoke(app, args, env={"SIM2EDGE_HOME": str(tmp / "home"), "COLUMNS": "220"})


def test_shards_are_contiguous_and_cover_the_suite_once():
    assert shards(3, 2, 2) == [[(0, (0, 1)), (1, (0,))], [(1, (1,)), (2, (0, 1))]]
    assert shards(1, 3, 2) == [[(0, (0, 1))], [(0, (2,))]] and shards(1, 1, 2) == [[], [(0, (0,))]]


def test_two_devices_share_the_suite_and_merge_to_the_one_device_result(devices, tmp_path):
    tmp, (a, b) = devices
    done = evaluate(tmp, [a], tmp_path / "one.json")
    assert done.exit_code == 0, done.output
    done = evaluate(tmp, [a, b], tmp_path / "two.json")
    assert done.exit_code == 0, done.output
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["device"] == f"{a}, {b}" and two["passed"] and "<td>gain-15%</td>" in (tmp_path / "two.html").read_text()
    assert [r["scenario"] for r in two["scenarios"]] == list(SCENARIOS)
    ran = {s["device"] for r in two["scenarios"] for s in r["shards"]}
    assert ran == {a, b}  # each device ran a part
    split = two["scenarios"][1]["shards"]  # damping+30%: episode 0 on the first device, episode 1 on the second
    assert [(s["device"], s["episodes"]) for s in split] == [(a, [0]), (b, [1])]
    assert f"<td>{a}: 0; {b}: 1</td>" in (tmp_path / "two.html").read_text()  # the HTML says which ran what
    for r1, r2 in zip(one["scenarios"], two["scenarios"]):
        assert r2["in_process"] == r1["in_process"]  # the same seeds, the same in-process side
        assert r2["hil"]["episodes"] == r1["hil"]["episodes"] == EPISODES and r2["hil"]["steps"] == EPISODES * STEPS
        assert sum(len(s["episodes"]) for s in r2["shards"]) == EPISODES
        for s in r2["shards"]:  # each device's own statistics over its part
            assert s["policy"] == f"balancer v1 (graph {bundled_graph(tmp / 'b.tar')[:12]})", s  # the bundle's graph
            assert s["runtime"] == "onnxruntime (CPUExecutionProvider)"
            assert s["counters"]["observations"] >= len(s["episodes"]) * STEPS
        assert r2["device"]["observations"] == sum(s["counters"]["observations"] for s in r2["shards"])
        # over a clean loopback an action lands within a substep of in-process's (tests/test_hil.py: within 5%
        # of it), so two real-time runs on the same seeds agree within twice that
        assert r2["hil"]["mean_return"] == pytest.approx(r1["hil"]["mean_return"], rel=0.1)
        assert r2["hil"]["mean_return"] == pytest.approx(r2["in_process"]["mean_return"], rel=0.05)
        assert r2["hil"]["falls"] == r1["hil"]["falls"] == 0


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_device_among_two_is_named_and_nothing_is_written(devices, tmp_path):
    tmp, (a, _) = devices
    dead = f"udp://127.0.0.1:{free_udp_port()}"
    done = evaluate(tmp, [a, dead], tmp_path / "r.json")
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    assert f"--hil: {dead}: no answer" in done.output and "Traceback" not in done.output, done.output
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()


def kill_once_serving(proc, address: str, timeout_s: float = 60) -> None:
    """SIGKILL the agent at ``address`` once it has answered HIL observations (its part of the run has begun)."""
    link, deadline = DeviceLink(address), time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and (link.stats(timeout_s=0.2, tries=1) or {}).get("observations", 0) < 20:
            time.sleep(0.05)
    finally:
        link.close()
    proc.kill()


def test_a_device_dying_mid_run_is_named_and_the_others_work_is_not_reported(devices, tmp_path):
    tmp, (a, _) = devices
    proc, b = serve(tmp / "store", "udp://127.0.0.1:0")
    killer = threading.Thread(target=kill_once_serving, args=(proc, b))
    killer.start()
    try:
        done = evaluate(tmp, [a, b], tmp_path / "r.json")
    finally:
        killer.join()
        proc.communicate(timeout=10)
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    # silent for 25 periods within its episode, or, killed near an episode's end, unanswered probes at the next
    assert re.search(rf"--hil: {re.escape(b)}: (scenario '[^']+', episode \d, step \d+: no action for 25 periods|"
                     rf"the device answered none of)", done.output), done.output
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()


def test_devices_serving_different_versions_are_refused_naming_both(devices, tmp_path):
    tmp, (a, _) = devices
    root, _ = cartpole_store(tmp_path, version="2")
    proc, other = serve(root, "udp://127.0.0.1:0", version="2")
    try:
        done = evaluate(tmp, [a, other], tmp_path / "r.json")
    finally:
        stop(proc)
    assert done.exit_code == 2 and done.output.strip().count("\n") == 0, done.output
    assert re.search(rf"{a} serves balancer v1 \(graph [0-9a-f]{{12}}\), {other} serves balancer v2 \(graph "
                     rf"[0-9a-f]{{12}}\)", done.output), done.output
    assert not (tmp_path / "r.json").exists()


def test_the_same_device_twice_is_refused(devices):
    tmp, (a, _) = devices
    done = evaluate(tmp, [a, a], tmp / "never.json")
    assert done.exit_code == 2 and f"--hil: device {a} is given twice" in done.output, done.output


def test_the_pipeline_stage_shards_across_a_list_of_devices(devices, tmp_path):
    tmp, (a, b) = devices
    params = resolve("cartpole", None, [f"hil={{device: [{a}, {b}], episodes: 2, max_steps: {STEPS}}}"], {})
    assert params.hil.devices == (a, b) and HilSettings(device=a).devices == (a,)  # one address still works
    cfg = params.hil.model_copy(update={"gate_file": tmp / "gate.yaml"})
    report = run_hil_stage(cfg, tmp / "b.tar", tmp / "k.pub", tmp / "policy.onnx", "cartpole",
                           hil_task("cartpole").nominal_params(), SEED, tmp_path)
    assert report.passed and report.device == f"{a}, {b}", report.checks
    assert [(s["device"], s["episodes"]) for s in report.scenarios[0]["shards"]] == [(a, [0]), (b, [1])]
    assert hil_metrics(report)["hil.nominal.falls"] == 0
