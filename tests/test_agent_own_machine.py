"""The device agent against its own machine and the registry's redirects: links planted in the store,
redirects to other origins (with credentials, to ``ftp:``), JSON nested without bound, a version number
of 5,000 digits, a wall clock that jumped, and a full disk.

Each case runs the real ``sim2edge-agent`` and makes the checks of tests/agent_checks.py: the exit code,
one stderr line naming the check, a journaled refusal, nothing left behind, a sibling directory (what a
link or redirect points at) unchanged, and ``current`` still verifying.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from edge.store import DeviceStore
from tests.agent_checks import PATH, agent, assert_refused, genuine, offer_tar, snapshot
from tests.conftest import run_cli
from tests.hostile_registry import ALIAS, ARTIFACTS, GET_VERSION, HostileRegistry, model_version

CENTURY_S = 100 * 365.25 * 86400


def plant(root: Path, where: str, target: Path) -> Path:
    """Replace ``root/where`` (file, empty directory or nothing) by a symbolic link to ``target``."""
    link = root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_dir() and not link.is_symlink():
        link.rmdir()
    elif os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    return link


def command(name: str, registry: HostileRegistry, root: Path, pub: Path) -> list:
    return {"pull": ["pull", "tiny@champion", "--registry", registry.url, "--root", str(root), "--trust", str(pub),
                     "--skip-target-check", "--attempts", "1", "--ignore-backoff"],
            "gc": ["gc", "--root", str(root), "--keep", "1"],
            "repair": ["repair", "--registry", registry.url, "--root", str(root), "--trust", str(pub),
                       "--attempts", "1"]}[name]


# -- 1: links in the store -------------------------------------------------------------------------------------

LINKS = [  # (the store's own path, what outside it points at, the command, journaled)
    ("tmp", "dir", "pull", True),
    ("tmp", "dir", "gc", True),
    ("bundles/evil", ".", "gc", True),
    ("bundles/evil", ".", "repair", True),
    ("bundles/tiny/7", "dir", "gc", True),
    ("downloads", "dir", "pull", True),
    ("lock", "keep.txt", "pull", True),
    ("lock", "keep.txt", "gc", True),
    ("journal.jsonl", "keep.txt", "pull", False),
]


@pytest.mark.parametrize("where,target,cmd,journaled", LINKS, ids=[f"{w}-{c}" for w, _, c, _ in LINKS])
def test_a_link_planted_in_the_store_is_refused_and_nothing_outside_is_touched(tmp_path, keys, registry, sibling,
                                                                                active, where, target, cmd, journaled):
    for version in ("1", "2"):  # what `gc --keep 1` would delete through bundles/evil
        (sibling / version).mkdir()
        (sibling / version / "policy.onnx").write_bytes(b"outside")
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    before = snapshot(sibling)
    link = plant(active, where, sibling / target)
    r = run_cli("sim2edge-agent", *command(cmd, registry, active, keys[1]))
    assert str(link) in r.stderr, r.stderr
    link.unlink()  # the checks below look at the store, not through the link
    if journaled:
        assert_refused(r, "store", active, sibling, before, keys[1])
    else:
        assert r.returncode == 1 and r.stderr.startswith("sim2edge-agent: store: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and snapshot(sibling) == before
    assert registry.downloads() == 1 and DeviceStore(active).link("current").name == "1"  # v1's, by `active`
    r = run_cli("sim2edge-agent", *command(cmd, registry, active, keys[1]))
    assert r.returncode == 0, r.stderr  # with the link gone, the same command works


def test_a_store_root_that_is_a_link_keeps_working(tmp_path, keys, registry):
    real = tmp_path / "real-store"
    real.mkdir()
    (tmp_path / "store").symlink_to(real)
    offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
    r = agent(registry, "pull", "tiny@champion", tmp_path / "store", keys[1])
    assert r.returncode == 0, r.stderr
    assert DeviceStore(real).link("current") == real / "bundles" / "tiny" / "1"


# -- 2, 3: redirects ---------------------------------------------------------------------------------------------

CREDENTIALS = {"bearer": {"MLFLOW_TRACKING_TOKEN": "s3cret-token"},
               "basic": {"MLFLOW_TRACKING_USERNAME": "robot", "MLFLOW_TRACKING_PASSWORD": "s3cret-pass"}}


@pytest.fixture()
def elsewhere():
    """Another origin: the same kind of server on 127.0.0.2, logging every request and its headers."""
    r = HostileRegistry(host="127.0.0.2")
    yield r
    r.close()


@pytest.mark.parametrize("auth", sorted(CREDENTIALS))
@pytest.mark.parametrize("request_,origin", [("alias", "host"), ("alias", "port"), ("artifact", "host")])
def test_a_redirect_to_another_origin_is_refused_and_sends_it_nothing(tmp_path, keys, registry, sibling, active,
                                                                      elsewhere, request_, origin, auth):
    other = elsewhere if origin == "host" else HostileRegistry()
    try:
        offer_tar(registry, genuine(tmp_path, keys[0], "2"))
        path = ALIAS if request_ == "alias" else ARTIFACTS + PATH
        registry.redirects[path] = other.url + path
        before = snapshot(sibling)
        r = agent(registry, "pull", "tiny@champion", active, keys[1], env=CREDENTIALS[auth])
        assert_refused(r, "registry", active, sibling, before, keys[1])
        assert "redirected (HTTP 302)" in r.stderr and other.url in r.stderr and "s3cret" not in r.stderr
        assert other.log == []  # not a byte sent there, credentials least of all
    finally:
        if other is not elsewhere:
            other.close()


def test_a_redirect_within_the_registry_is_followed_with_its_credentials(tmp_path, keys, registry, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    registry.redirects[ALIAS] = registry.url + GET_VERSION + "?name=tiny&version=2"
    r = agent(registry, "pull", "tiny@champion", active, keys[1], env=CREDENTIALS["bearer"])
    assert r.returncode == 0, r.stderr
    assert [p for _, p in registry.log[-3:-1]] == [ALIAS, GET_VERSION]
    assert registry.headers[-2]["Authorization"] == "Bearer s3cret-token"
    assert DeviceStore(active).link("current").name == "2"


def test_a_redirect_to_a_dripping_ftp_server_is_refused_within_the_deadline(tmp_path, keys, registry, sibling,
                                                                            active):
    ftp = socket.socket()
    ftp.bind(("127.0.0.2", 0))
    ftp.listen()
    accepted = []

    def drip() -> None:  # an FTP greeting, one byte a second
        conn, _ = ftp.accept()
        accepted.append(conn)
        for byte in b"220 slow ftp\r\n":
            conn.send(bytes([byte]))
            time.sleep(1)

    threading.Thread(target=drip, daemon=True).start()
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    registry.redirects[ALIAS] = f"ftp://127.0.0.2:{ftp.getsockname()[1]}/bundle.tar"
    before = snapshot(sibling)
    start = time.monotonic()
    r = agent(registry, "pull", "tiny@champion", active, keys[1], "--deadline", "5")
    assert time.monotonic() - start < 5
    assert_refused(r, "registry", active, sibling, before, keys[1])
    assert "ftp://127.0.0.2" in r.stderr and accepted == []
    assert run_cli("sim2edge-agent", "gc", "--root", str(active)).returncode == 0  # the lock was released
    ftp.close()


# -- 4, 5: JSON nested without bound, a version number of 5,000 digits -------------------------------------------

@pytest.mark.parametrize("depth", [40, 5_000, 100_000])
def test_deeply_nested_json_is_refused_as_a_registry_answer(tmp_path, keys, registry, sibling, active, depth):
    registry.routes[ALIAS] = b"[" * depth + b"]" * depth
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@champion", active, keys[1])
    assert_refused(r, "registry", active, sibling, before, keys[1])
    assert "nested deeper than 32 levels" in r.stderr


def test_a_version_number_of_5000_digits_is_refused_not_retried(tmp_path, keys, registry, sibling, active):
    answer = json.dumps(model_version("tiny", 7, PATH, "a" * 64, "100")).replace('"version": 7', '"version": ' + "9" * 5000)
    registry.routes[ALIAS] = answer.encode()
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@champion", active, keys[1])
    assert_refused(r, "registry", active, sibling, before, keys[1])
    assert "is not a positive version number" in r.stderr
    assert not (DeviceStore(active).backoff_state() or {}).get("failures")  # not counted as unavailable


# -- 6: a wall clock that jumped ----------------------------------------------------------------------------------

def test_a_backoff_recorded_a_century_ahead_waits_at_most_its_delay(tmp_path, keys, registry, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    store = DeviceStore(active)
    ahead = time.time() + CENTURY_S
    for next_attempt, bound in ((ahead + CENTURY_S, 1800.0), (ahead + 1.0, 1.0)):
        (active / "backoff.json").write_text(json.dumps({"registry": registry.url, "failures": 3, "last_error": "x",
                                                         "last_attempt": ahead, "next_attempt": next_attempt}))
        r = run_cli("sim2edge-agent", "pull", "tiny@champion", "--registry", registry.url, "--root", str(active),
                    "--trust", str(keys[1]), "--skip-target-check", "--attempts", "1")
        assert r.returncode == 3 and r.stderr.startswith("sim2edge-agent: backoff: "), r.stderr
        assert float(re.search(r"next attempt in ([0-9.]+) s", r.stderr).group(1)) <= bound
        assert store.backoff_state()["last_attempt"] <= time.time()  # counted from now on
    time.sleep(1.2)
    r = run_cli("sim2edge-agent", "pull", "tiny@champion", "--registry", registry.url, "--root", str(active),
                "--trust", str(keys[1]), "--skip-target-check", "--attempts", "1")
    assert r.returncode == 0, r.stderr
    assert store.link("current").name == "2"


# -- 7: a full disk -----------------------------------------------------------------------------------------------

@pytest.fixture()
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the project's machines and CI run as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("pad,during", [(2 << 20, "download"), (600_000, "extract")])
def test_a_full_disk_is_refused_as_disk_and_the_retry_succeeds(tmp_path, keys, registry, sibling, small_disk, pad,
                                                               during):
    root = small_disk / "store"
    offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
    assert agent(registry, "pull", "tiny@champion", root, keys[1]).returncode == 0
    offer_tar(registry, genuine(tmp_path, keys[0], "2", pad_bytes=pad))
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@champion", root, keys[1])
    assert_refused(r, "disk", root, sibling, before, keys[1], code=2)
    assert "bytes free" in r.stderr and str(root) in r.stderr
    assert DeviceStore(root).failed_versions() == {}  # the disk, not the bundle: not known-bad
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    r = agent(registry, "pull", "tiny@champion", root, keys[1])
    assert r.returncode == 0, r.stderr
    assert DeviceStore(root).link("current").name == "2"


def test_min_free_refuses_before_downloading(tmp_path, keys, registry, sibling, small_disk):
    root = small_disk / "store"
    offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
    assert agent(registry, "pull", "tiny@champion", root, keys[1]).returncode == 0
    offer_tar(registry, genuine(tmp_path, keys[0], "2", pad_bytes=600_000))
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@champion", root, keys[1], "--min-free", "0")
    assert_refused(r, "disk", root, sibling, before, keys[1], code=2)
    assert "--min-free 0" in r.stderr and registry.downloads() == 1  # v1's download only


def test_telemetry_and_engine_folders_that_are_links_are_refused(tmp_path, sibling):
    from edge.errors import CheckFailed
    from edge.telemetry import Recorder
    from edge.tensorrt import EngineCache, EngineKey

    before = snapshot(sibling)
    plant(tmp_path / "store", "telemetry", sibling)
    with pytest.raises(CheckFailed, match=r"^store: .*/store/telemetry is a symbolic link"):
        Recorder(tmp_path / "store", ["a"], ["u"], "1", "dev")
    plant(tmp_path / "store", "engines", sibling)
    key = EngineKey("10.3", "8.7", "fp16", "a" * 64)
    with pytest.raises(CheckFailed, match=r"^store: .*/store/engines is a symbolic link"):
        EngineCache(tmp_path / "store" / "engines").put(key, b"plan")
    assert snapshot(sibling) == before
