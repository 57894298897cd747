"""`sim2edge publish` to a TUF repository served by a real nginx on loopback, and `sim2edge-agent pull --tuf`:
publish → pull installs and runs; each attack is refused with `current` untouched (tests/agent_checks.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from registry.tuf_repo import PublishConfig, RepoConfig, publish, write_rollout
from tests.agent_checks import assert_refused, snapshot
from tests.bundles import make_bundle, make_keys
from tests.bundles import publish as register
from tests.conftest import free_port, run_cli
from tests.servers import start_nginx, stop_nginx

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="needs Debian's nginx (make nginx)")


@pytest.fixture(scope="module")
def nginx(tmp_path_factory):
    """nginx as this test's own process: serves ``<dir>/www`` on a loopback port; yields (www, base URL)."""
    d = tmp_path_factory.mktemp("nginx")
    port = free_port()
    proc = start_nginx(d, port)
    yield d / "www", f"http://127.0.0.1:{port}"
    stop_nginx(d, proc)


@pytest.fixture()
def repo(nginx, tmp_path, request):
    """An empty repository served by nginx under this test's name: (directory, URL, key directory)."""
    www, base = nginx
    name = request.node.name.replace("[", "-").replace("]", "")
    return www / name, f"{base}/{name}", tmp_path / "tuf-keys"


def put(repo, bundle_key: Path, tmp: Path, version: str, **cfg) -> Path:
    """Package tiny v``version`` with the real packager and publish it; returns the bundle."""
    tar = tmp / f"tiny-{version}.tar"
    make_bundle(tar, bundle_key, version=version, name="tiny")
    publish(PublishConfig(repo=repo[0], keys=repo[2], bundle=tar, policy="tiny", version=version, **cfg))
    return tar


def pull_args(repo, ref: str, root: Path, pub: Path) -> list[str]:
    return ["pull", ref, "--tuf", repo[1], "--tuf-root", str(repo[0] / "metadata/root.json"), "--root", str(root),
            "--trust", str(pub), "--skip-target-check", "--attempts", "1", "--backoff", "0", "--ignore-backoff"]


def pull(repo, ref: str, root: Path, pub: Path) -> subprocess.CompletedProcess:
    return run_cli("sim2edge-agent", *pull_args(repo, ref, root, pub))


@pytest.fixture()
def device(repo, tmp_path):
    """Keys, and a store whose ``current`` is tiny v1 pulled through TUF: (private key, public key, store root)."""
    priv, pub = make_keys(tmp_path)
    put(repo, priv, tmp_path, "1")
    root = tmp_path / "store"
    r = pull(repo, "tiny", root, pub)
    assert r.returncode == 0 and "activated tiny v1" in r.stdout, r.stderr
    return priv, pub, root


def refused(r, device, sibling, before, check="tuf", code=1, error="") -> None:
    """The agent's one-line refusal (tests/agent_checks.py), ``current`` still the same, TUF's error named."""
    assert_refused(r, check, device[2], sibling, before, device[1], code)
    assert error in r.stderr, r.stderr


def current(root: Path) -> str:
    return os.readlink(root / "current")


def test_publish_from_the_registry_then_pull_installs_and_runs(repo, tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    priv, pub = make_keys(tmp_path)
    for v in ("1", "2"):
        tar = tmp_path / f"tuftiny-{v}.tar"
        make_bundle(tar, priv, version=v, name="tuftiny")
        assert register(mlflow_server, tar, "tuftiny", "champion") == v
    done = run_cli("sim2edge", "publish", "tuftiny@champion", "--repo", str(repo[0]), "--keys", str(repo[2]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "published tuftiny v2" in done.stdout and "timestamp v1" in done.stdout
    root = tmp_path / "store"
    r = pull(repo, "tuftiny", root, pub)
    assert r.returncode == 0 and "activated tuftiny v2" in r.stdout, r.stderr
    tag = json.loads(MlflowClient(mlflow_server).get_model_version("tuftiny", "2").tags["sim2edge.tuf"])
    assert tag["target_path"] == "tuftiny/2.tar" and tag["repo"] == str(repo[0].resolve())
    assert oct((repo[2] / "root.key").stat().st_mode & 0o777) == "0o600" and not list(repo[0].rglob("*.key"))
    again = pull(repo, "tuftiny@2", root, pub)
    assert again.returncode == 0 and "already active" in again.stdout, again.stderr
    assert [json.loads(line) for line in (root / "journal.jsonl").read_text().splitlines()][-1]["source"] == repo[1]
    bench = run_cli("sim2edge-agent", "bench", "--root", str(root), "--iterations", "200", "--json")
    assert bench.returncode == 0 and json.loads(bench.stdout)["policy"] == "tuftiny", bench.stderr


def test_publish_bumps_versions_keeps_latest_newest_and_refuses_a_mislabelled_bundle(repo, tmp_path):
    from tuf.api.metadata import Metadata

    priv, _ = make_keys(tmp_path)
    put(repo, priv, tmp_path, "2")
    put(repo, priv, tmp_path, "1")  # an older version published later: latest.tar stays v2
    meta = repo[0] / "metadata"
    targets = Metadata.from_file(str(meta / "targets.json")).signed
    assert targets.version == 2 and Metadata.from_file(str(meta / "timestamp.json")).signed.version == 2
    assert targets.targets["tiny/latest.tar"].unrecognized_fields["custom"]["sim2edge"]["version"] == "2"
    assert sorted(targets.targets) == ["tiny/1.tar", "tiny/2.tar", "tiny/latest.tar"]
    with pytest.raises(ValueError, match="is tiny v1, not tiny v3"):
        publish(PublishConfig(repo=repo[0], keys=repo[2], bundle=tmp_path / "tiny-1.tar", policy="tiny", version="3"))
    with pytest.raises(ValueError, match=r"holds 0 root key\(s\) of"):
        publish(PublishConfig(repo=repo[0], keys=tmp_path / "other-keys", bundle=tmp_path / "tiny-1.tar", policy="tiny",
                              version="1"))


def test_tampered_target_bytes_are_refused(repo, device, tmp_path, sibling):
    put(repo, device[0], tmp_path, "2")
    target = repo[0] / "targets/tiny/2.tar"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    before, was = snapshot(sibling), current(device[2])
    refused(pull(repo, "tiny@2", device[2], device[1]), device, sibling, before, error="LengthOrHashMismatchError")
    assert current(device[2]) == was


def test_endless_data_is_refused(repo, device, tmp_path, sibling):
    put(repo, device[0], tmp_path, "2")
    with open(repo[0] / "targets/tiny/latest.tar", "ab") as f:
        f.write(b"\0" * (1 << 20))
    before = snapshot(sibling)
    refused(pull(repo, "tiny", device[2], device[1]), device, sibling, before, error="DownloadLengthMismatchError")


def test_rollback_to_older_metadata_is_refused(repo, device, tmp_path, sibling):
    old = tmp_path / "old-metadata"
    shutil.copytree(repo[0] / "metadata", old)
    put(repo, device[0], tmp_path, "2")
    r = pull(repo, "tiny", device[2], device[1])
    assert r.returncode == 0 and "activated tiny v2" in r.stdout, r.stderr
    for f in ("timestamp.json", "snapshot.json", "targets.json"):
        shutil.copyfile(old / f, repo[0] / "metadata" / f)  # the v1 repository served again
    before, was = snapshot(sibling), current(device[2])
    refused(pull(repo, "tiny", device[2], device[1]), device, sibling, before, error="BadVersionNumberError")
    assert current(device[2]) == was and was.endswith("tiny/2")


def test_frozen_repository_is_refused_once_its_timestamp_expires(repo, device, tmp_path, sibling):
    put(repo, device[0], tmp_path, "2", timestamp_s=1.0)
    time.sleep(2.1)
    before = snapshot(sibling)
    refused(pull(repo, "tiny", device[2], device[1]), device, sibling, before, error="ExpiredMetadataError")


def test_mix_and_match_snapshot_is_refused(repo, device, tmp_path, sibling):
    old_snapshot = (repo[0] / "metadata/snapshot.json").read_bytes()
    put(repo, device[0], tmp_path, "2")
    (repo[0] / "metadata/snapshot.json").write_bytes(old_snapshot)  # timestamp v2 names snapshot v2
    before = snapshot(sibling)
    refused(pull(repo, "tiny", device[2], device[1]), device, sibling, before, error="BadVersionNumberError")


def test_custom_fields_that_disagree_with_the_manifest_are_refused(repo, device, tmp_path, sibling):
    """The repository's own keys sign a lie (v2's bundle as v3): the bundle's signed manifest refuses it."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    from securesystemslib.signer import CryptoSigner
    from tuf.api.metadata import Metadata, MetaFile

    put(repo, device[0], tmp_path, "2")
    meta = repo[0] / "metadata"
    md = {role: Metadata.from_file(str(meta / f"{role}.json")) for role in ("targets", "snapshot", "timestamp")}
    lie = md["targets"].signed.targets["tiny/2.tar"]
    shutil.copyfile(repo[0] / "targets/tiny/2.tar", repo[0] / "targets/tiny/3.tar")
    lie.path = "tiny/3.tar"
    lie.unrecognized_fields["custom"]["sim2edge"]["version"] = "3"
    md["targets"].signed.targets["tiny/3.tar"] = lie
    md["targets"].signed.version += 1
    md["snapshot"].signed.meta["targets.json"] = MetaFile(md["targets"].signed.version)
    md["snapshot"].signed.version += 1
    md["timestamp"].signed.snapshot_meta = MetaFile(md["snapshot"].signed.version)
    md["timestamp"].signed.version += 1
    for role in ("targets", "snapshot", "timestamp"):
        md[role].signatures.clear()
        md[role].sign(CryptoSigner(load_pem_private_key((repo[2] / f"{role}.key").read_bytes(), None)))
        md[role].to_file(str(meta / f"{role}.json"))
    before = snapshot(sibling)
    refused(pull(repo, "tiny@3", device[2], device[1]), device, sibling, before, check="manifest",
            error="bundle is tiny v2")


def test_unknown_policy_and_unreachable_repository_are_refused(repo, device, sibling):
    before = snapshot(sibling)
    refused(pull(repo, "nosuch", device[2], device[1]), device, sibling, before, error="no target nosuch/latest.tar")
    gone = (repo[0], f"http://127.0.0.1:{free_port()}", repo[2])
    refused(pull(gone, "tiny", device[2], device[1]), device, sibling, before, code=3, error="unavailable")


def test_watch_through_tuf_activates_new_versions_and_says_a_refusal_once(repo, device, tmp_path):
    def watch() -> subprocess.CompletedProcess:
        args = pull_args(repo, "tiny", device[2], device[1])
        return run_cli("sim2edge-agent", "watch", *args[1:], "--iterations", "2", "--interval", "0.1")

    put(repo, device[0], tmp_path, "2")
    r = watch()
    assert r.returncode == 0 and r.stdout.count("watch: activated tiny v2") == 1 and not r.stderr, r.stdout + r.stderr
    put(repo, device[0], tmp_path, "3")
    latest = repo[0] / "targets/tiny/latest.tar"
    latest.write_bytes(b"x" * latest.stat().st_size)
    r = watch()
    assert r.returncode == 0 and r.stderr.count("watch: tuf: LengthOrHashMismatchError") == 1, r.stderr
    assert current(device[2]).endswith("tiny/2")


@pytest.mark.device
def test_pull_through_tuf_on_python38(repo, tmp_path):
    """The agent installed alone on JetPack 5's CPython 3.8 (tuf 5.1) reads the repository tuf 7 wrote."""
    from tests.test_edge_pythons import edge_venv

    agent = str(edge_venv("3.8") / "bin" / "sim2edge-agent")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONWARNINGS": "ignore"}  # cryptography on 3.8
    priv, pub = make_keys(tmp_path)
    put(repo, priv, tmp_path, "1")
    root = tmp_path / "store"
    r = subprocess.run([agent, *pull_args(repo, "tiny", root, pub)], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0 and "activated tiny v1" in r.stdout, r.stderr
    put(repo, priv, tmp_path, "2")
    (repo[0] / "targets/tiny/latest.tar").write_bytes(b"x" * (repo[0] / "targets/tiny/2.tar").stat().st_size)
    r = subprocess.run([agent, *pull_args(repo, "tiny", root, pub)], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.startswith("sim2edge-agent: tuf: LengthOrHashMismatchError"), r.stderr
    assert current(root).endswith("tiny/1")


def plan(canary: str | None, rest: str = "1") -> dict:
    """A rollout of tiny: ring ``canary`` (devices labelled site=lab) at ``canary``, everyone else at ``rest``."""
    return {"policy": "tiny", "default": rest,
            "rings": [{"name": "canary", "match": {"site": "lab"}, "percent": None, "version": canary},
                      {"name": "all", "match": {}, "percent": None, "version": rest}]}


def test_a_rollout_gives_each_ring_its_version_and_a_halt_rolls_its_ring_back(repo, tmp_path):
    priv, pub = make_keys(tmp_path)
    for v in ("1", "2"):
        put(repo, priv, tmp_path, v)  # latest.tar is v2
    cfg = RepoConfig(repo=repo[0], keys=repo[2])
    write_rollout(cfg, "tiny", plan("2"))

    def device(name: str, site: str) -> subprocess.CompletedProcess:
        return run_cli("sim2edge-agent", *pull_args(repo, "tiny", tmp_path / name, pub), "--device-id", name,
                       "--label", f"site={site}")

    r = device("lab-1", "lab")
    assert r.returncode == 0 and "activated tiny v2" in r.stdout, r.stderr
    r = device("field-1", "field")  # the rollout holds it at v1 though latest.tar is v2
    assert r.returncode == 0 and "activated tiny v1" in r.stdout, r.stderr
    write_rollout(cfg, "tiny", plan("1"))  # the canary ring halted and rolled back
    r = device("lab-1", "lab")
    assert r.returncode == 0 and "activated tiny v1" in r.stdout and current(tmp_path / "lab-1").endswith("/1"), r.stderr
    before = (repo[0] / "metadata/targets.json").read_bytes()
    with pytest.raises(ValueError, match=r"version\(s\) \['9'\] not published"):
        write_rollout(cfg, "tiny", plan("9"))
    assert (repo[0] / "metadata/targets.json").read_bytes() == before
    r = device("field-2", "field")
    assert r.returncode == 0 and "activated tiny v1" in r.stdout, r.stderr
    write_rollout(cfg, "tiny", None)  # the rollout withdrawn: devices follow latest.tar again
    r = device("field-2", "field")
    assert r.returncode == 0 and "activated tiny v2" in r.stdout, r.stderr


def test_a_ring_without_a_version_leaves_the_device_as_it_is(repo, tmp_path):
    priv, pub = make_keys(tmp_path)
    put(repo, priv, tmp_path, "1")
    write_rollout(RepoConfig(repo=repo[0], keys=repo[2]), "tiny", {**plan("1"), "default": None,
                  "rings": [{"name": "canary", "match": {"site": "lab"}, "percent": None, "version": "1"}]})
    r = run_cli("sim2edge-agent", *pull_args(repo, "tiny", tmp_path / "dev", pub), "--device-id", "dev")
    assert r.returncode == 1 and "rollout:" in r.stderr and "(in no ring) no version yet" in r.stderr, r.stderr
    assert not (tmp_path / "dev" / "current").exists()
