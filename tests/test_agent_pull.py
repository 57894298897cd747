"""Pull robustness against a real MLflow server on loopback, through a fault-injecting proxy.

Faults: server 500, connection drop mid-download (resumed with Range), truncated download,
oversized response (with and without Content-Length), a stalled response (timeout), a server
that ignores Range (full re-download), a bundle declared over the size limit, the server down
(current unchanged, backoff persisted). One test runs against ``mlflow server --app-name basic-auth``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from edge import signing
from edge.errors import CheckFailed
from edge.pull import PullOptions, pull
from edge.errors import RegistryUnavailable
from edge.registry_client import TransferOptions
from edge.store import DeviceStore
from tests.bundles import GATE_FAILED, FaultProxy, make_bundle, make_keys, publish
from tests.conftest import free_port, run_cli

FAST = PullOptions(TransferOptions(attempts=4, backoff_base_s=0.01, timeout_s=5), backoff_base_s=0.5)
PAD = 600_000  # big enough that a half body spans several 64 KiB reads


@pytest.fixture()
def keys(tmp_path):
    return make_keys(tmp_path)


@pytest.fixture()
def proxy(mlflow_server):
    p = FaultProxy(mlflow_server, stall_s=2.0)
    yield p
    p.close()


def new_policy(url: str, tmp: Path, priv: Path, versions: int = 1, **kw) -> str:
    """A fresh policy name with ``versions`` published versions (each with a bundle), ``champion`` on the last."""
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    for v in range(1, versions + 1):
        tar = tmp / f"{name}-{v}.tar"
        make_bundle(tar, priv, version=str(v), name=name, **kw)
        assert publish(url, tar, name, "champion" if v == versions else None) == str(v)
    return name


def pull_v(name, version, url, root, pub, **opts):
    return pull(f"{name}@{version}", url, root, signing.load_trusted([pub]), skip_target_check=True,
                options=opts.pop("options", FAST))


def current_version(root: Path):
    m = DeviceStore(root).current_manifest()
    return m and m["policy"]["version"]


def test_drop_mid_download_resumes_with_range(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0], pad_bytes=PAD)
    proxy.faults = ["drop"]
    result = pull_v(name, 1, proxy.url, tmp_path / "store", keys[1])
    assert result.changed and current_version(tmp_path / "store") == "1"
    (first, second) = proxy.log
    assert first[1] is None and second[1] and second[1].startswith("bytes=")
    assert int(second[1][6:-1]) > 0, "the retry resumed from byte 0"
    # MLflow's artifact proxy serves local artifacts with Flask's send_file: Range is honoured
    assert second[2] == 206 and result.download.range_honoured is True
    assert result.download.resumed_from == int(second[1][6:-1])
    assert not list((tmp_path / "store" / "downloads").iterdir()), "the finished download was not cleaned up"


def test_server_ignoring_range_gets_a_full_download(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0], pad_bytes=PAD)
    proxy.faults = ["drop", "norange"]
    result = pull_v(name, 1, proxy.url, tmp_path / "store", keys[1])
    assert result.changed and proxy.log[1][2] == 200
    assert result.download.range_honoured is False and result.download.resumed_from == 0


def test_server_500_and_stall_are_retried(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0])
    proxy.faults = ["500", "stall", "500"]
    opts = PullOptions(TransferOptions(attempts=4, backoff_base_s=0.01, timeout_s=0.5))
    start = time.monotonic()
    result = pull_v(name, 1, proxy.url, tmp_path / "store", keys[1], options=opts)
    assert result.changed and result.download.attempts == 4
    assert [e[3] for e in proxy.log] == ["500", "stall", "500", None]
    assert time.monotonic() - start < 1.8, "the stalled response was not cut off by the timeout"


def test_persistent_500_is_unavailable_and_keeps_current(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0], versions=2)
    root = tmp_path / "store"
    pull_v(name, 1, proxy.url, root, keys[1])
    proxy.faults = ["500"] * 4
    with pytest.raises(RegistryUnavailable, match=r"unavailable.*after 4 attempts.*HTTP 500.*current policy unchanged"):
        pull_v(name, 2, proxy.url, root, keys[1])
    assert current_version(root) == "1" and len(proxy.log) == 5
    assert DeviceStore(root).backoff_state()["failures"] == 1


def test_truncated_download_resumes_then_persistent_truncation_is_refused(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0], versions=2, pad_bytes=PAD)
    root = tmp_path / "store"
    proxy.faults = ["truncate"]
    result = pull_v(name, 1, proxy.url, root, keys[1])
    assert result.changed and proxy.log[1][1].startswith("bytes=") and proxy.log[1][2] == 206, proxy.log
    proxy.faults = ["truncate"] * 4  # each answer brings half of what is missing: never complete
    with pytest.raises(CheckFailed, match=r"size: download of .* stayed truncated after 4 attempts"):
        pull_v(name, 2, proxy.url, root, keys[1])
    assert current_version(root) == "1"
    assert not list((root / "tmp").iterdir()), "staging left behind"


@pytest.mark.parametrize("fault", ["oversize", "oversize-nolength"])
def test_oversized_response_is_refused_not_retried(mlflow_server, proxy, keys, tmp_path, fault):
    name = new_policy(mlflow_server, tmp_path, keys[0], versions=2)
    root = tmp_path / "store"
    pull_v(name, 1, proxy.url, root, keys[1])
    proxy.log.clear()
    proxy.faults = [fault]
    with pytest.raises(CheckFailed, match=r"^size: .*oversized response refused"):
        pull_v(name, 2, proxy.url, root, keys[1])
    assert len(proxy.log) == 1, "an oversized response must not be retried"
    assert current_version(root) == "1"
    assert not list((root / "downloads").iterdir()), "the oversized partial download was kept"
    assert DeviceStore(root).history()[-1]["check"] == "size"


def test_bundle_declared_over_the_limit_is_not_downloaded(mlflow_server, proxy, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0])
    opts = PullOptions(TransferOptions(max_bytes=1000))
    with pytest.raises(CheckFailed, match=r"size: .* declares \d+ bytes, over this device's limit of 1000"):
        pull_v(name, 1, proxy.url, tmp_path / "store", keys[1], options=opts)
    assert proxy.log == []


def test_registry_down_keeps_current_and_backs_off(mlflow_server, keys, tmp_path):
    name = new_policy(mlflow_server, tmp_path, keys[0], versions=2)
    root = tmp_path / "store"
    pull_v(name, 1, mlflow_server, root, keys[1])
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RegistryUnavailable, match=r"is unreachable.*current policy unchanged"):
        pull_v(name, 2, down, root, keys[1])
    state = DeviceStore(root).backoff_state()
    assert current_version(root) == "1" and state["failures"] == 1 and state["registry"] == down
    assert 0.25 <= state["next_attempt"] - state["last_attempt"] <= 0.5  # base 0.5 s, equal jitter
    # the next attempt inside the window does not touch the network and says why
    start = time.monotonic()
    with pytest.raises(CheckFailed, match=r"^backoff: registry .* unavailable on the last 1 attempt"):
        pull_v(name, 2, down, root, keys[1])
    assert time.monotonic() - start < 0.3
    # the CLI says the same in one line, exit code 2, current unchanged
    r = run_cli("sim2edge-agent", "pull", f"{name}@2", "--registry", down, "--root", str(root),
                "--trust", str(keys[1]), "--skip-target-check", "--ignore-backoff", "--attempts", "2",
                "--retry-base", "0.01")
    assert r.returncode == 3 and "is unreachable" in r.stderr and "current policy unchanged" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1
    state = DeviceStore(root).backoff_state()
    assert state["failures"] == 2 and 30 <= state["next_attempt"] - state["last_attempt"] <= 60  # CLI base 30 s, doubled
    assert current_version(root) == "1"
    events = [e["event"] for e in DeviceStore(root).history()]
    assert events == ["activate", "unavailable", "unavailable"]
    # back online: a pull succeeds and clears the backoff
    assert pull_v(name, 2, mlflow_server, root, keys[1]).changed
    assert DeviceStore(root).backoff_state() == {"failures": 0} and current_version(root) == "2"


# -- the server's basic-auth app -------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _auth_server_process(tmp_path_factory):
    """Start ``mlflow server --app-name basic-auth`` first (autouse, session scope), so that it boots while
    the shared MLflow server boots; ``auth_server`` waits for it. Yields (process, url, password, log)."""
    d = tmp_path_factory.mktemp("mlflow-auth")
    password = "S2e-" + uuid.uuid4().hex
    ini = d / "auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{d}/auth.db\n"
                   f"admin_username = admin\nadmin_password = {password}\n"
                   f"authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   f"auth_cache_ttl_seconds = 300\n")  # PBKDF2 once per (user, password), not per request
    port = free_port()
    env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_FLASK_SERVER_SECRET_KEY=uuid.uuid4().hex)
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD"):
        env.pop(k, None)
    log = d / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
                                 "--backend-store-uri", f"sqlite:///{d}/mlflow.db", "--artifacts-destination",
                                 str(d / "art"), "--serve-artifacts", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "1"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    yield proc, f"http://127.0.0.1:{port}", password, log
    os.killpg(proc.pid, 9)
    proc.wait()


@pytest.fixture()
def auth_server(_auth_server_process):
    """The basic-auth server once healthy: (url, admin user, admin password)."""
    import urllib.request

    proc, url, password, log = _auth_server_process
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return url, "admin", password
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"basic-auth MLflow server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.3)


def test_pull_from_basic_auth_server_never_shows_the_password(auth_server, keys, tmp_path, monkeypatch):
    url, user, password = auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    name = new_policy(url, tmp_path, keys[0], versions=1, pad_bytes=PAD)
    proxy = FaultProxy(url)
    try:
        root = tmp_path / "store"
        args = ["--root", str(root), "--trust", str(keys[1]), "--skip-target-check", "--retry-base", "0.01"]
        # no credentials: refused, naming what to set
        anon = run_cli("sim2edge-agent", "pull", f"{name}@1", "--registry", url, *args,
                       unset=("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"))
        assert anon.returncode == 2 and "refused the credentials (HTTP 401)" in anon.stderr, anon.stderr
        wrong = run_cli("sim2edge-agent", "pull", f"{name}@1", "--registry", url, *args,
                        env={"MLFLOW_TRACKING_PASSWORD": password[:-1] + "x"})
        assert wrong.returncode == 2 and "HTTP 401" in wrong.stderr
        # right credentials, through the proxy, with a drop mid-download: resumed with Range, authenticated
        proxy.faults = ["drop"]
        ok = run_cli("sim2edge-agent", "pull", f"{name}@champion", "--registry", proxy.url, *args)
        assert ok.returncode == 0 and "activated" in ok.stdout, ok.stderr
        assert [e[2] for e in proxy.log] == [200, 206]
        again = run_cli("sim2edge-agent", "pull", f"{name}@champion", "--registry", url, *args)
        assert again.returncode == 0 and "already active" in again.stdout
        history = run_cli("sim2edge-agent", "history", "--root", str(root))
        texts = [anon.stdout, anon.stderr, wrong.stdout, wrong.stderr, ok.stdout, ok.stderr, again.stdout,
                 again.stderr, history.stdout, (root / "journal.jsonl").read_text()]
        for text in texts:
            assert password not in text and password[:-1] not in text
        assert json.loads(history.stdout.splitlines()[-1])["resumed_from"] > 0
    finally:
        proxy.close()


def test_refusals_and_outages_change_no_file_of_the_store(mlflow_server, keys, tmp_path):
    """Only the journal's and the backoff file's contents change: no file appears or goes, current stays."""
    name = new_policy(mlflow_server, tmp_path, keys[0])
    root = tmp_path / "store"
    pull_v(name, 1, mlflow_server, root, keys[1])

    def snapshot():
        return sorted(str(p.relative_to(root)) for p in root.rglob("*")), os.readlink(root / "current")

    before = snapshot()
    with pytest.raises(CheckFailed, match="alias nope not found"):
        pull_v(name, "nope", mlflow_server, root, keys[1])
    with pytest.raises(RegistryUnavailable, match=r"^registry: registry http://127\.0\.0\.1:\d+ is unreachable "):
        pull_v(name, 1, f"http://127.0.0.1:{free_port()}", root, keys[1])
    assert snapshot() == before


def test_the_signed_gate_decides_what_a_device_installs(mlflow_server, keys, tmp_path):
    """Bundles from the real packager and registry writer: one whose signed evaluation failed the gate is
    published as ``challenger`` and refused (check ``gate``) unless allowed; one with no recorded evaluation
    (an imported policy) installs like a passed one."""
    name = new_policy(mlflow_server, tmp_path, keys[0])  # v1: gate passed, champion
    root = tmp_path / "store"
    pull_v(name, "champion", mlflow_server, root, keys[1])
    make_bundle(tmp_path / "failed.tar", keys[0], version="2", name=name, evaluation=GATE_FAILED)
    assert publish(mlflow_server, tmp_path / "failed.tar", name, "challenger") == "2"
    assert MlflowClient(mlflow_server).get_model_version(name, "2").tags["sim2edge.gate"] == "fail"
    with pytest.raises(CheckFailed, match=rf"^gate: {name} v2 failed its evaluation gate when it was packaged "
                                          r"\(success rate 0\.4, a challenger\)"):
        pull_v(name, "challenger", mlflow_server, root, keys[1])
    assert current_version(root) == "1"
    pull_v(name, "challenger", mlflow_server, root, keys[1], options=replace(FAST, allow_failed_gate=True))
    assert current_version(root) == "2"
    make_bundle(tmp_path / "ungated.tar", keys[0], version="3", name=name, evaluation=None)
    assert publish(mlflow_server, tmp_path / "ungated.tar", name, "champion") == "3"
    pull_v(name, "champion", mlflow_server, root, keys[1])
    assert current_version(root) == "3" and DeviceStore(root).current_manifest()["evaluation"] is None
