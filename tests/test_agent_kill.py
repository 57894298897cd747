"""kill -9 of the agent at every step of install and activation, repeated: ``current`` always verifies.

The agent runs in real child processes that die by SIGKILL: either at a named crash point
(``SIM2EDGE_AGENT_KILL_AT``, one per step in :data:`edge.crash.STEPS`) or at a random instant
chosen by the parent. A small driver process imports the agent once and forks one child per
trial (each child runs ``edge.cli.main``, the console script's entry point), so a trial costs
the pull itself rather than an interpreter start; three trials use the real console script.
After each kill: the agent's own ``verify`` passes on ``current`` (and ``previous``), then a
later pull completes, leaving no staging, half-made link or partial download behind.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from edge import cli, crash, signing
from edge.pull import PullOptions, pull
from edge.registry_client import TransferOptions
from edge.store import DeviceStore
from tests.bundles import make_bundle, make_keys, publish
from tests.conftest import run_cli

REPEATS = 4          # hook trials per step: 11 steps x 4 = 44
RANDOM_TRIALS = 16   # kills at random instants
ACTIVE_AFTER = {s: ("2" if s in ("activated", "journaled") else "1") for s in crash.STEPS}
FAST = PullOptions(TransferOptions(attempts=3, backoff_base_s=0.01, timeout_s=5))

DRIVER = r"""
import json, os, signal, sys, time
from edge import cli, pull, bundle, smoke, store, registry_client   # imported once, before forking
for line in sys.stdin:
    job = json.loads(line)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1); os.dup2(fd, 2)
        if job["kill_at"]:
            os.environ["SIM2EDGE_AGENT_KILL_AT"] = job["kill_at"]
        os._exit(cli.main(job["args"]))
    if job["delay"] is not None:
        time.sleep(job["delay"])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "rc": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                      "elapsed": time.monotonic() - start}), flush=True)
"""


@pytest.fixture(scope="module")
def setup(mlflow_server, tmp_path_factory):
    """A policy with versions 1 and 2 in the registry, and a store with v1 active."""
    tmp = tmp_path_factory.mktemp("kill")
    priv, pub = make_keys(tmp)
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    for v in ("1", "2"):
        make_bundle(tmp / f"{v}.tar", priv, version=v, name=name)
        assert publish(mlflow_server, tmp / f"{v}.tar", name) == v
    base = tmp / "base"
    pull(f"{name}@1", mlflow_server, base, signing.load_trusted([pub]), True, FAST)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=str(Path(__file__).resolve().parents[1]))
    yield name, pub, base, driver, tmp
    driver.stdin.close()
    driver.wait(10)


def trial_store(base: Path, tmp: Path, label: str) -> Path:
    root = tmp / label
    shutil.copytree(base, root, symlinks=True)
    return root


def run_trial(driver, args, log: Path, kill_at=None, delay=None) -> dict:
    driver.stdin.write(json.dumps({"args": args, "kill_at": kill_at, "delay": delay, "log": str(log)}) + "\n")
    driver.stdin.flush()
    return json.loads(driver.stdout.readline())


def check_after_kill(root: Path, pub: Path, name: str, url: str, capsys) -> str:
    """``current`` verifies (the agent's own verify); then a later pull completes. Returns the version active
    right after the kill."""
    store = DeviceStore(root)
    capsys.readouterr()
    assert cli.main(["verify", "--root", str(root), "--trust", str(pub)]) == 0, capsys.readouterr()
    after_kill = store.current_manifest()["policy"]["version"]
    previous = store.link("previous")
    if previous is not None:
        from edge import bundle
        bundle.verify_dir(previous, signing.load_trusted([pub]))
    pull(f"{name}@2", url, root, signing.load_trusted([pub]), True, FAST)
    assert store.current_manifest()["policy"]["version"] == "2"
    assert cli.main(["verify", "--root", str(root), "--trust", str(pub)]) == 0
    assert store.link("previous") == store.bundle_dir(name, "1")
    assert not list((root / "tmp").iterdir()), "staging left behind"
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "half-made link or file left behind"
    assert not list((root / "downloads").glob("*.part")), "partial download left behind"
    events = store.history()
    assert events[-1]["event"] in ("activate", "recovered") and events[-1]["version"] == "2"
    return after_kill


def test_kill_at_every_step_of_install_and_activation(setup, mlflow_server, capsys):
    name, pub, base, driver, tmp = setup
    args = ["pull", f"{name}@2", "--registry", mlflow_server, "--trust", str(pub), "--skip-target-check",
            "--retry-base", "0.01"]
    seen = {}
    for k in range(REPEATS):
        for step in crash.STEPS:
            root = trial_store(base, tmp, f"{step}-{k}")
            result = run_trial(driver, args + ["--root", str(root)], tmp / f"{step}-{k}.log", kill_at=step)
            assert result["signal"] == 9, f"agent was not killed at {step}: {result}, {(tmp / f'{step}-{k}.log').read_text()}"
            seen[step] = check_after_kill(root, pub, name, mlflow_server, capsys)
            assert seen[step] == ACTIVE_AFTER[step], f"after a kill at {step}, current is v{seen[step]}"
    assert set(seen) == set(crash.STEPS)


def test_kill_at_random_instants(setup, mlflow_server, capsys):
    name, pub, base, driver, tmp = setup
    args = ["pull", f"{name}@2", "--registry", mlflow_server, "--trust", str(pub), "--skip-target-check"]
    clean = run_trial(driver, args + ["--root", str(trial_store(base, tmp, "clean"))], tmp / "clean.log")
    assert clean["rc"] == 0, (tmp / "clean.log").read_text()
    rng = random.Random(7)
    outcomes = {"1": 0, "2": 0}
    for i in range(RANDOM_TRIALS):
        root = trial_store(base, tmp, f"random-{i}")
        result = run_trial(driver, args + ["--root", str(root)], tmp / f"random-{i}.log",
                           delay=rng.uniform(0, clean["elapsed"]))
        assert result["signal"] == 9 or result["rc"] == 0, result
        outcomes[check_after_kill(root, pub, name, mlflow_server, capsys)] += 1
    assert outcomes["1"] > 0, "no random kill landed before the switch"


@pytest.mark.parametrize("step", ["download", "current-link", "journaled"])
def test_kill_of_the_console_script(setup, mlflow_server, capsys, step):
    name, pub, base, _, tmp = setup
    root = trial_store(base, tmp, f"cli-{step}")
    r = run_cli("sim2edge-agent", "pull", f"{name}@2", "--registry", mlflow_server, "--root", str(root),
                "--trust", str(pub), "--skip-target-check", env={crash.ENV: step})
    assert r.returncode == -9, r.stderr
    assert check_after_kill(root, pub, name, mlflow_server, capsys) == ACTIVE_AFTER[step]


def test_a_journal_line_torn_by_a_kill_is_skipped_and_not_glued_to_the_next(tmp_path):
    store = DeviceStore(tmp_path)
    store.record("activate", policy="p", version="1")
    with open(store.journal_path, "a") as f:
        f.write('{"event": "activ')  # what a writer killed mid-line leaves
    store.record("rollback", policy="p", version="1")
    assert [e["event"] for e in store.history()] == ["activate", "rollback"]
    assert store.journal_path.read_text().splitlines()[1] == '{"event": "activ'
