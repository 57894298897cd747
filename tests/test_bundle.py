"""The bundle contract: deterministic writing, and every refusal naming its check."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import onnx
import pytest

from edge import bundle, signing
from edge.errors import CheckFailed
from edge.smoke import smoke_test
from tests.bundles import golden, make_bundle, make_keys, manifest, tiny_onnx


@pytest.fixture()
def keys(tmp_path):
    return make_keys(tmp_path)


def unpack(tar: Path, dest: Path, trusted) -> dict:
    """As the device does: authenticate and unpack, then verify the unpacked copy as a stored one is."""
    dest.mkdir()
    manifest = bundle.extract(tar, dest, max_bytes=1 << 24, trusted=trusted)
    assert bundle.verify_dir(dest, trusted) == manifest
    return manifest


def test_same_inputs_same_bytes(tmp_path, keys):
    a = make_bundle(tmp_path / "a.tar", keys[0])
    b = make_bundle(tmp_path / "b.tar", keys[0])
    assert a == b and (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert [m.name for m in tar] == sorted(m.name for m in tar)
        assert all(m.mtime == 0 and m.uid == 0 for m in tar)


def test_good_bundle_verifies_and_smokes(tmp_path, keys):
    make_bundle(tmp_path / "b.tar", keys[0])
    m = unpack(tmp_path / "b.tar", tmp_path / "x", signing.load_trusted([keys[1]]))
    released, exported = onnx.load(str(tmp_path / "x" / "policy.onnx")), onnx.load_from_string(tiny_onnx())
    assert list(released.graph.node) == list(exported.graph.node)  # the packager annotates, never changes the graph
    assert list(released.graph.initializer) == list(exported.graph.initializer)
    assert m["files"]["policy.onnx"]["length"] == (tmp_path / "x" / "policy.onnx").stat().st_size
    assert smoke_test(tmp_path / "x", m).max_abs_error < 1e-6


def test_key_rotation_accepts_any_pinned_key(tmp_path, keys):
    old = make_keys(tmp_path, "old")
    make_bundle(tmp_path / "b.tar", keys[0])
    unpack(tmp_path / "b.tar", tmp_path / "x", signing.load_trusted([old[1], keys[1]]))


def rewrite(tar: Path, out: Path, edit) -> None:
    """Copy ``tar`` to ``out`` with ``edit(name, data) -> (name, data) | None`` applied per member."""
    with tarfile.open(tar) as src, tarfile.open(out, "w") as dst:
        for m in src:
            res = edit(m.name, src.extractfile(m).read())
            if res is None:
                continue
            info = tarfile.TarInfo(res[0])
            info.size = len(res[1])
            dst.addfile(info, io.BytesIO(res[1]))


def flip(data: bytes) -> bytes:
    return data[:10] + bytes([data[10] ^ 1]) + data[11:]


@pytest.mark.parametrize("member,check", [("policy.onnx", "hash"), ("golden.npz", "hash"),
                                          ("manifest.json", "signature"), ("manifest.sig", "signature")])
def test_flipped_byte_in_each_file_is_refused(tmp_path, keys, member, check):
    make_bundle(tmp_path / "b.tar", keys[0])
    rewrite(tmp_path / "b.tar", tmp_path / "bad.tar", lambda n, d: (n, flip(d) if n == member else d))
    with pytest.raises(CheckFailed) as e:
        unpack(tmp_path / "bad.tar", tmp_path / "x", signing.load_trusted([keys[1]]))
    assert e.value.check == check


def test_manifest_edited_after_signing(tmp_path, keys):
    make_bundle(tmp_path / "b.tar", keys[0])

    def edit(n, d):
        if n != "manifest.json":
            return n, d
        m = json.loads(d)
        m["control"]["period_s"] = 1.0
        return n, bundle.manifest_bytes(m)

    rewrite(tmp_path / "b.tar", tmp_path / "bad.tar", edit)
    with pytest.raises(CheckFailed, match="signature: manifest signature does not match"):
        unpack(tmp_path / "bad.tar", tmp_path / "x", signing.load_trusted([keys[1]]))


def test_wrong_key_and_unsigned(tmp_path, keys):
    other = make_keys(tmp_path, "other")
    make_bundle(tmp_path / "b.tar", keys[0])
    with pytest.raises(CheckFailed, match=r"^signature: manifest signature does not match any trusted key$"):
        unpack(tmp_path / "b.tar", tmp_path / "x", signing.load_trusted([other[1]]))
    rewrite(tmp_path / "b.tar", tmp_path / "unsigned.tar", lambda n, d: None if n == "manifest.sig" else (n, d))
    with pytest.raises(CheckFailed, match=r"^signature: manifest\.sig is missing \(unsigned bundle\)$"):
        unpack(tmp_path / "unsigned.tar", tmp_path / "y", signing.load_trusted([keys[1]]))


def test_extra_and_missing_files(tmp_path, keys):
    make_bundle(tmp_path / "b.tar", keys[0])
    trusted = signing.load_trusted([keys[1]])
    rewrite(tmp_path / "b.tar", tmp_path / "extra.tar", lambda n, d: (n, d))
    with tarfile.open(tmp_path / "extra.tar", "a") as tar:
        info = tarfile.TarInfo("notes.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(CheckFailed, match="extra file 'notes.txt'"):
        unpack(tmp_path / "extra.tar", tmp_path / "x", trusted)
    rewrite(tmp_path / "b.tar", tmp_path / "missing.tar", lambda n, d: None if n == "golden.npz" else (n, d))
    with pytest.raises(CheckFailed, match="'golden.npz' listed in the manifest is missing"):
        unpack(tmp_path / "missing.tar", tmp_path / "y", trusted)


@pytest.mark.parametrize("name", ["../escape.onnx", "/etc/passwd", "engines/../../x"])
def test_paths_leaving_the_bundle_are_refused(tmp_path, keys, name):
    make_bundle(tmp_path / "b.tar", keys[0])
    rewrite(tmp_path / "b.tar", tmp_path / "bad.tar", lambda n, d: (name if n == "golden.npz" else n, d))
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckFailed, match="archive: member path"):
        bundle.extract(tmp_path / "bad.tar", tmp_path / "x", 1 << 24)
    assert not (tmp_path / "escape.onnx").exists()


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])
def test_links_and_devices_are_refused(tmp_path, keys, kind):
    make_bundle(tmp_path / "b.tar", keys[0])
    rewrite(tmp_path / "b.tar", tmp_path / "bad.tar", lambda n, d: (n, d))
    with tarfile.open(tmp_path / "bad.tar", "a") as tar:
        info = tarfile.TarInfo("engines/x.plan")
        info.type, info.linkname = kind, "/etc/passwd"
        tar.addfile(info)
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckFailed, match="not a regular file"):
        bundle.extract(tmp_path / "bad.tar", tmp_path / "x", 1 << 24)


def test_oversized_and_truncated(tmp_path, keys):
    make_bundle(tmp_path / "b.tar", keys[0])
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckFailed, match=r"^size: bundle unpacks to \d+ bytes, more than 100$"):
        bundle.extract(tmp_path / "b.tar", tmp_path / "x", max_bytes=100)
    with tarfile.open(tmp_path / "b.tar") as tar:
        cut = tar.getmember("policy.onnx").offset_data + 10
    (tmp_path / "cut.tar").write_bytes((tmp_path / "b.tar").read_bytes()[:cut])
    with pytest.raises(CheckFailed) as e:
        unpack(tmp_path / "cut.tar", tmp_path / "y", signing.load_trusted([keys[1]]))
    assert e.value.check in ("archive", "files")


def test_unknown_format_version(tmp_path, keys):
    key = signing.load_private(keys[0])
    m = dict(manifest(), format=bundle.FORMAT, format_version=99,
             files={n: {"sha256": bundle.sha256_bytes(b), "length": len(b)}
                    for n, b in {"policy.onnx": tiny_onnx(), "golden.npz": golden()}.items()})
    d = tmp_path / "x"
    d.mkdir()
    (d / "policy.onnx").write_bytes(tiny_onnx())
    (d / "golden.npz").write_bytes(golden())
    (d / "manifest.json").write_bytes(bundle.manifest_bytes(m))
    (d / "manifest.sig").write_bytes(key.sign(bundle.manifest_bytes(m)))
    with pytest.raises(CheckFailed, match="format: unknown bundle format 'sim2edge-bundle' version 99"):
        bundle.verify_dir(d, signing.load_trusted([keys[1]]))


def test_golden_mismatch_and_too_slow_fail_the_smoke_test(tmp_path, keys):
    trusted = signing.load_trusted([keys[1]])
    make_bundle(tmp_path / "g.tar", keys[0], files={"policy.onnx": tiny_onnx(0.4), "golden.npz": golden(0.5)})
    m = unpack(tmp_path / "g.tar", tmp_path / "g", trusted)
    with pytest.raises(CheckFailed, match="smoke: golden outputs differ"):
        smoke_test(tmp_path / "g", m)
    make_bundle(tmp_path / "s.tar", keys[0], period_s=1e-9)
    m = unpack(tmp_path / "s.tar", tmp_path / "s", trusted)
    with pytest.raises(CheckFailed, match="latency: inference p99"):
        smoke_test(tmp_path / "s", m)


def test_private_key_is_created_private(tmp_path):
    priv, _ = make_keys(tmp_path)
    assert os.stat(priv).st_mode & 0o077 == 0


def test_rollback_without_previous_is_refused(tmp_path, keys):
    from edge.pull import rollback

    with pytest.raises(CheckFailed, match="rollback: there is no previous policy"):
        rollback(tmp_path / "store", signing.load_trusted([keys[1]]))
