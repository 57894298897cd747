"""Multi-key role thresholds (``<keys>/layout.json``, registry/tuf_repo.py) on a repository served by real nginx on
loopback, pulled by the real agent: a targets threshold of 2 installs; targets signed by 1 of its 2 keys is refused
with `current` untouched; a publish with fewer keys than a threshold is refused in one line, the repository
unchanged; a 2-of-3 root rotates with 2 of its keys and the device follows."""

from __future__ import annotations

import json

import pytest

from registry.tuf_repo import key_layout
from registry.tuf_rotation import RotateConfig, rotate_root
from tests.agent_checks import snapshot
from tests.test_tuf import current, device, nginx, pull, put, refused  # noqa: F401  (fixtures)
from tests.test_tuf import pytestmark  # noqa: F401  (needs nginx)
from tests.test_tuf_rotation import trusted_root

LAYOUT = {"root": {"keys": 3, "threshold": 2}, "targets": {"keys": 2, "threshold": 2}}


def write_layout(keys) -> None:
    keys.mkdir(parents=True, exist_ok=True)
    (keys / "layout.json").write_text(json.dumps(LAYOUT))


@pytest.fixture()
def repo(nginx, tmp_path, request):  # noqa: F811
    """As tests/test_tuf.py's, its key directory laid out as ``LAYOUT``: (directory, URL, key directory)."""
    www, base = nginx
    name = request.node.name.replace("[", "-").replace("]", "")
    write_layout(tmp_path / "tuf-keys")
    return www / name, f"{base}/{name}", tmp_path / "tuf-keys"


def test_root_lists_every_key_with_its_threshold_and_each_role_carries_its_signatures(repo, device):
    from tuf.api.metadata import Metadata

    meta = repo[0] / "metadata"
    root = Metadata.from_file(str(meta / "root.json"))
    counts = {role: (len(r.keyids), r.threshold) for role, r in root.signed.roles.items()}
    assert counts == {"root": (3, 2), "targets": (2, 2), "snapshot": (1, 1), "timestamp": (1, 1)}
    assert len(root.signatures) == 3 and len(Metadata.from_file(str(meta / "targets.json")).signatures) == 2
    assert sorted(p.name for p in repo[2].glob("targets*.key")) == ["targets-2.key", "targets.key"]
    assert current(device[2]).endswith("tiny/1")  # the device fixture pulled v1 through the agent


def test_targets_signed_by_one_of_its_two_keys_is_refused(repo, device, tmp_path, sibling):
    from tuf.api.metadata import Metadata

    put(repo, device[0], tmp_path, "2")
    path = repo[0] / "metadata/targets.json"
    targets = Metadata.from_file(str(path))
    del targets.signatures[next(iter(targets.signatures))]  # snapshot names targets' version only: still valid
    targets.to_file(str(path))
    before, was = snapshot(sibling), current(device[2])
    r = pull(repo, "tiny", device[2], device[1])
    refused(r, device, sibling, before, error="UnsignedMetadataError")
    assert "targets was signed by 1/2 keys" in r.stderr
    assert current(device[2]) == was and was.endswith("tiny/1")


def test_a_publish_with_fewer_keys_than_a_threshold_is_refused_and_changes_nothing(repo, tmp_path):
    from tests.bundles import make_keys

    priv, _ = make_keys(tmp_path)
    put(repo, priv, tmp_path, "1")
    (repo[2] / "targets-2.key").unlink()
    before = snapshot(repo[0])
    with pytest.raises(ValueError) as e:
        put(repo, priv, tmp_path, "2")
    assert f"{repo[2]} holds 1 targets key(s) of {repo[0] / 'metadata/root.json'}, threshold 2" in str(e.value)
    assert "\n" not in str(e.value) and snapshot(repo[0]) == before
    (repo[2] / "layout.json").write_text(json.dumps({"targets": {"keys": 1, "threshold": 2}}))
    with pytest.raises(ValueError, match="layout.json is not a key layout .*threshold 2 exceeds its 1 key"):
        key_layout(repo[2])


def test_a_two_of_three_root_rotates_with_two_of_its_keys_and_the_device_follows(repo, device, tmp_path):
    from tuf.api.metadata import Metadata

    (repo[2] / "root-3.key").unlink()  # one root key lost: the threshold of 2 still rotates
    new = tmp_path / "new-keys"
    write_layout(new)
    done = rotate_root(RotateConfig(repo=repo[0], keys=repo[2], new_keys=new))
    assert done.rotated == ["root", "targets", "snapshot", "timestamp"]
    v2 = Metadata.from_file(str(repo[0] / "metadata/2.root.json"))
    assert len(v2.signatures) == 5 and v2.signed.roles["root"].threshold == 2
    after = (repo[0], repo[1], new)
    put(after, device[0], tmp_path, "2")
    r = pull(after, "tiny", device[2], device[1])
    assert r.returncode == 0 and "activated tiny v2" in r.stdout and trusted_root(device[2]) == 2, r.stderr


def test_a_rotation_can_replace_one_key_of_a_two_of_three_root(repo, tmp_path):
    import shutil

    from tuf.api.metadata import Metadata

    from tests.bundles import make_keys

    put(repo, make_keys(tmp_path)[0], tmp_path, "1")
    new = tmp_path / "new-keys"
    write_layout(new)
    for name in ("root.key", "root-2.key", "targets.key", "targets-2.key", "snapshot.key", "timestamp.key"):
        shutil.copyfile(repo[2] / name, new / name)  # root-3.key alone is replaced
    done = rotate_root(RotateConfig(repo=repo[0], keys=repo[2], new_keys=new))
    assert done.rotated == ["root"]
    meta = repo[0] / "metadata"
    v1, v2 = (Metadata.from_file(str(meta / f"{n}.root.json")) for n in (1, 2))
    assert len(set(v1.signed.roles["root"].keyids) & set(v2.signed.roles["root"].keyids)) == 2
    v1.verify_delegate("root", v2)
    v2.verify_delegate("root", v2)
