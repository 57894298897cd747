"""`sim2edge tuf rotate-root` (registry/tuf_rotation.py) on a repository served by real nginx on loopback, pulled by
the real agent: a device that trusted root v1 follows the rotation and installs what the new keys publish; a root
v2 the old root key did not sign, and metadata a retired key signs, are refused with `current` untouched; a refused
rotation leaves the repository as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from registry.tuf_repo import PublishConfig, load_signer, publish, role_signers
from registry.tuf_rotation import RotateConfig, rotate_root
from tests.agent_checks import snapshot
from tests.bundles import make_bundle, make_keys
from tests.conftest import run_cli
from tests.test_tuf import current, device, nginx, pull, pull_args, put, refused, repo  # noqa: F401  (fixtures)
from tests.test_tuf import pytestmark  # noqa: F401  (needs nginx)

TOP = ("targets", "snapshot", "timestamp")


def trusted_root(store: Path) -> int:
    """The version of the root the device trusts (edge/tuf_client.py keeps it under ``<store>/tuf/<key>/``)."""
    from tuf.api.metadata import Metadata

    (found,) = store.glob("tuf/*/root.json")
    return Metadata.from_file(str(found)).signed.version


def rotated(repo, tmp_path: Path):
    """Rotate every key of ``repo`` to ``<tmp>/new-keys``; the repository tuple with the new key directory."""
    new = tmp_path / "new-keys"
    done = rotate_root(RotateConfig(repo=repo[0], keys=repo[2], new_keys=new))
    assert (done.root_version, done.rotated) == (2, ["root", "targets", "snapshot", "timestamp"]), done
    return repo[0], repo[1], new


def forge(meta: Path, keys: Path) -> None:
    """Targets, snapshot and timestamp as they are, versions bumped by one, signed with the role keys in ``keys``."""
    from tuf.api.metadata import Metadata, MetaFile

    md = {role: Metadata.from_file(str(meta / f"{role}.json")) for role in TOP}
    md["targets"].signed.version += 1
    md["snapshot"].signed.meta["targets.json"] = MetaFile(md["targets"].signed.version)
    md["snapshot"].signed.version += 1
    md["timestamp"].signed.snapshot_meta = MetaFile(md["snapshot"].signed.version)
    md["timestamp"].signed.version += 1
    for role in TOP:
        md[role].signatures.clear()
        md[role].sign(load_signer(keys / f"{role}.key"))
        md[role].to_file(str(meta / f"{role}.json"))


def test_a_device_trusting_root_v1_follows_the_rotation_and_installs_what_the_new_keys_publish(repo, device,
                                                                                                  tmp_path):
    from tuf.api.metadata import Metadata

    meta = repo[0] / "metadata"
    shipped = tmp_path / "root-v1.json"  # what devices got out of band before the rotation
    shutil.copyfile(meta / "root.json", shipped)
    assert trusted_root(device[2]) == 1
    new = tmp_path / "new-keys"
    r = run_cli("sim2edge", "tuf", "rotate-root", "--repo", str(repo[0]), "--keys", str(repo[2]),
                "--new-keys", str(new))
    assert r.returncode == 0 and "to root v2" in r.stdout and f"retire {repo[2]}" in r.stdout, r.stdout + r.stderr
    v2 = Metadata.from_file(str(meta / "2.root.json"))
    assert (meta / "2.root.json").read_bytes() == (meta / "root.json").read_bytes()
    assert (meta / "1.root.json").read_bytes() == shipped.read_bytes()
    v1 = Metadata.from_file(str(shipped))
    old_ids = {load_signer(repo[2] / f"{role}.key").public_key.keyid for role in ("root", *TOP)}
    assert set(v2.signatures) == {load_signer(new / "root.key").public_key.keyid,
                                  load_signer(repo[2] / "root.key").public_key.keyid}
    assert not old_ids & set(v2.signed.keys) and len(v2.signed.keys) == 4
    v1.verify_delegate("root", v2)
    for role in TOP:
        v2.verify_delegate(role, Metadata.from_file(str(meta / f"{role}.json")))
    with pytest.raises(ValueError, match=r"holds 0 root key\(s\) of"):  # the old key directory publishes no more
        put(repo, device[0], tmp_path, "2")
    after = (repo[0], repo[1], new)
    put(after, device[0], tmp_path, "2")
    r = pull(after, "tiny", device[2], device[1])
    assert r.returncode == 0 and "activated tiny v2" in r.stdout, r.stderr
    assert trusted_root(device[2]) == 2
    fresh = tmp_path / "fresh"  # a device first started after the rotation with the root shipped before it
    args = pull_args(after, "tiny", fresh, device[1])
    args[args.index("--tuf-root") + 1] = str(shipped)
    r = run_cli("sim2edge-agent", *args)
    assert r.returncode == 0 and "activated tiny v2" in r.stdout, r.stderr
    assert trusted_root(fresh) == 2


def test_a_root_v2_the_old_root_key_did_not_sign_is_refused(repo, device, tmp_path, sibling):
    from tuf.api.metadata import Metadata

    after = rotated(repo, tmp_path)
    put(after, device[0], tmp_path, "2")
    meta = repo[0] / "metadata"
    v2 = Metadata.from_file(str(meta / "2.root.json"))
    keep = load_signer(after[2] / "root.key").public_key.keyid
    for keyid in [k for k in v2.signatures if k != keep]:
        del v2.signatures[keyid]  # signed by the new root key alone
    v2.to_file(str(meta / "2.root.json"))
    v2.to_file(str(meta / "root.json"))
    before, was = snapshot(sibling), current(device[2])
    r = pull(after, "tiny", device[2], device[1])
    refused(r, device, sibling, before, error="UnsignedMetadataError")
    assert "root was signed by 0/1 keys" in r.stderr
    assert current(device[2]) == was and was.endswith("tiny/1") and trusted_root(device[2]) == 1


def test_metadata_a_retired_key_signs_after_the_rotation_is_refused(repo, device, tmp_path, sibling):
    from tuf.api.metadata import Metadata

    after = rotated(repo, tmp_path)
    put(after, device[0], tmp_path, "2")
    r = pull(after, "tiny", device[2], device[1])
    assert r.returncode == 0 and "activated tiny v2" in r.stdout and trusted_root(device[2]) == 2, r.stderr
    put(after, device[0], tmp_path, "3")
    meta = repo[0] / "metadata"
    v3 = Metadata.from_file(str(meta / "root.json"))  # the retired root key alone signs a root v3
    v3.signed.version = 3
    v3.signatures.clear()
    v3.sign(load_signer(repo[2] / "root.key"))
    v3.to_file(str(meta / "3.root.json"))
    before = snapshot(sibling)
    refused(pull(after, "tiny", device[2], device[1]), device, sibling, before, error="UnsignedMetadataError")
    assert current(device[2]).endswith("tiny/2") and trusted_root(device[2]) == 2
    (meta / "3.root.json").unlink()
    forge(meta, repo[2])  # v3's metadata re-signed by the retired targets, snapshot and timestamp keys
    r = pull(after, "tiny", device[2], device[1])
    refused(r, device, sibling, before, error="UnsignedMetadataError")
    assert "timestamp was signed by 0/1 keys" in r.stderr
    assert current(device[2]).endswith("tiny/2")
    forge(meta, after[2])  # the same, signed by the new keys: installs
    r = pull(after, "tiny", device[2], device[1])
    assert r.returncode == 0 and "activated tiny v3" in r.stdout, r.stderr


def test_a_refused_rotation_leaves_the_repository_as_it_was(repo, tmp_path):
    def contents() -> dict:
        """Each path with its mode and digest (a directory's mtime moves when a staged file is removed)."""
        return {path: (mode, digest) for path, (mode, _, _, digest) in snapshot(repo[0]).items()}

    def rotate(keys: Path, new: Path) -> str:
        before = contents()
        r = run_cli("sim2edge", "tuf", "rotate-root", "--repo", str(repo[0]), "--keys", str(keys),
                    "--new-keys", str(new))
        assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1, r.stdout + r.stderr
        assert r.stdout.startswith("error: ") and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert contents() == before
        return " ".join(r.stdout.split())

    repo[0].mkdir(parents=True)
    assert "metadata/root.json does not exist: publish to" in rotate(repo[2], tmp_path / "new")
    tar = tmp_path / "tiny-1.tar"
    make_bundle(tar, make_keys(tmp_path)[0], version="1", name="tiny")
    publish(PublishConfig(repo=repo[0], keys=repo[2], bundle=tar, policy="tiny", version="1"))
    assert "are the current key directory" in rotate(repo[2], repo[2])
    assert f"{tmp_path / 'nokeys' / 'root.key'} does not exist" in rotate(tmp_path / "nokeys", tmp_path / "new")
    role_signers(tmp_path / "other")
    assert "other holds 0 root key(s) of" in rotate(tmp_path / "other", tmp_path / "new")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "root.key").write_text("not a key\n")
    assert f"{bad / 'root.key'} is not an unencrypted PEM private key" in rotate(repo[2], bad)
    same = tmp_path / "same"
    same.mkdir()
    shutil.copyfile(repo[2] / "root.key", same / "root.key")
    assert "is already a root key of" in rotate(repo[2], same)
    obstacle = repo[0] / "metadata" / "timestamp.json.tmp"
    obstacle.mkdir()  # the last of the five files cannot be staged
    assert "Is a directory" in rotate(repo[2], tmp_path / "new")
    assert sorted(p.name for p in (repo[0] / "metadata").iterdir()) == [
        "1.root.json", "root.json", "snapshot.json", "targets.json", "timestamp.json", "timestamp.json.tmp"]
    obstacle.rmdir()
    snapshot_json = repo[0] / "metadata" / "snapshot.json"
    good = snapshot_json.read_bytes()
    snapshot_json.write_bytes(good[:-9])
    assert f"{snapshot_json} is not TUF metadata" in rotate(repo[2], tmp_path / "new")
    snapshot_json.write_bytes(good)
    for keys, new, version in ((repo[2], tmp_path / "new", 2), (tmp_path / "new", tmp_path / "newer", 3)):
        r = run_cli("sim2edge", "tuf", "rotate-root", "--repo", str(repo[0]), "--keys", str(keys),
                    "--new-keys", str(new))
        assert r.returncode == 0 and f"to root v{version}" in r.stdout, r.stdout + r.stderr
    meta = repo[0] / "metadata"
    shutil.copyfile(meta / "1.root.json", meta / "root.json")  # root.json set back by hand: v2 exists already
    assert "2.root.json exists but root.json is v1" in rotate(repo[2], tmp_path / "again")


@pytest.mark.device
def test_a_device_on_python38_follows_the_rotation(repo, tmp_path):
    """tuf 5.1's ngclient (JetPack 5's CPython 3.8) walks 2.root.json the same way, and refuses a retired key."""
    import os
    import subprocess

    from tests.test_edge_pythons import edge_venv

    agent = str(edge_venv("3.8") / "bin" / "sim2edge-agent")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONWARNINGS": "ignore"}
    priv, pub = make_keys(tmp_path)
    put(repo, priv, tmp_path, "1")
    root = tmp_path / "store"

    def pull38(where) -> subprocess.CompletedProcess:
        return subprocess.run([agent, *pull_args(where, "tiny", root, pub)], capture_output=True, text=True, env=env,
                              cwd=tmp_path)

    r = pull38(repo)
    assert r.returncode == 0 and "activated tiny v1" in r.stdout, r.stderr
    after = rotated(repo, tmp_path)
    put(after, priv, tmp_path, "2")
    r = pull38(after)
    assert r.returncode == 0 and "activated tiny v2" in r.stdout and trusted_root(root) == 2, r.stderr
    forge(repo[0] / "metadata", repo[2])
    r = pull38(after)
    assert r.returncode == 1 and r.stderr.startswith("sim2edge-agent: tuf: UnsignedMetadataError"), r.stderr
    assert current(root).endswith("tiny/2")
