"""Property-based tests (hypothesis) of the agent's parsers at its trust boundaries: valid inputs, randomly
mutated, never raise anything but the agent's own refusal (:class:`CheckFailed`; ``ValueError`` for a
command-line reference), and whatever they accept is a value the store can use safely."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge import bundle, signing
from edge.errors import CheckFailed
from edge.registry_answers import BundleRef, bundle_ref, parse_ref
from edge.store import DeviceStore
from edge.values import PolicyName
from tests.bundles import make_bundle, make_keys
from tests.hostile_registry import model_version

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=4), max_leaves=12)


def paths_of(value, prefix=()):
    """Every path (tuple of keys/indices) into a JSON value, the value itself included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths_of(v, prefix + (i,))


def replaced(value, path, new):
    if not path:
        return new
    out = copy.deepcopy(value)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return out


VALID = model_version("tiny", "3", "1/0123456789abcdef0123456789abcdef/artifacts/bundle/tiny.tar", "a" * 64, "10240")


@FUZZ
@given(data=st.data())
def test_registry_answers_parse_or_are_refused(tmp_path, data):
    answer = VALID
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths_of(answer))))
        answer = replaced(answer, path, data.draw(json_values))
    try:
        ref = bundle_ref(answer, PolicyName("tiny"), None, 1 << 30)
    except CheckFailed:
        return
    assert isinstance(ref, BundleRef)
    store = DeviceStore(tmp_path / "store")
    for p in (store.bundle_dir(ref.policy, ref.version), store.download_part(ref.sha256)):
        assert (tmp_path / "store").resolve() in p.resolve().parents


@FUZZ
@given(ref=st.text(max_size=40))
def test_references_parse_or_are_refused(ref):
    try:
        policy, alias, version = parse_ref(ref)
    except ValueError:
        return
    assert (alias is None) != (version is None)
    DeviceStore(Path("/nonexistent/store")).inside("bundles", policy, version or "1")


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    priv, pub = make_keys(tmp)
    make_bundle(tmp / "b.tar", priv, pad_bytes=3000)
    return (tmp / "b.tar").read_bytes(), signing.load_trusted([pub])


@pytest.fixture(scope="module")
def original(signed):
    """Every member of the genuine bundle, name → bytes, read with tarfile (not the agent's own code)."""
    with tarfile.open(fileobj=io.BytesIO(signed[0])) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers()}


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.integers(0, 255)),
    st.tuples(st.just("member"), st.integers(0, 1 << 20), st.integers(1, 255)))  # a byte of one member's data


def member_spans(data: bytes) -> list:
    """(offset, length) of every non-empty member's data in the tar ``data`` (read with tarfile)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return [(m.offset_data, m.size) for m in t.getmembers() if m.size]


def mutate(data: bytes, ops) -> bytes:
    spans = member_spans(data)
    buf = bytearray(data)
    for op, at, value in ops:
        if op == "member":  # flip a byte inside a member (the signature's 64 bytes too), not only at random
            offset, length = spans[at % len(spans)]
            at = offset + (at // len(spans)) % length
        at %= max(1, len(buf))
        if op in ("flip", "member") and buf:
            buf[at] ^= value
        elif op == "truncate":
            del buf[at:]
        else:
            buf[at:at] = bytes([value]) * 512
    return bytes(buf)


@FUZZ
@given(ops=st.lists(mutations, min_size=1, max_size=4))
def test_mutated_bundles_unpack_or_are_refused(signed, original, ops):
    tar, trusted = signed
    work = Path(tempfile.mkdtemp())
    try:
        (work / "b.tar").write_bytes(mutate(tar, ops))
        (work / "x").mkdir()
        try:
            manifest = bundle.extract(work / "b.tar", work / "x", 1 << 24, trusted)
        except CheckFailed:
            return
        # accepted: exactly the genuine bundle, byte for byte (the manifest and its signature included)
        got = {str(p.relative_to(work / "x")): p.read_bytes() for p in (work / "x").rglob("*") if p.is_file()}
        assert got == original
        assert manifest == json.loads(original[bundle.MANIFEST])
    finally:
        shutil.rmtree(work)


@FUZZ
@given(data=st.data())
def test_mutated_manifests_parse_or_are_refused(signed, data):
    tar, _ = signed
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        manifest = json.loads(t.extractfile(bundle.MANIFEST).read())
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths_of(manifest))))
        manifest = replaced(manifest, path, data.draw(json_values))
    try:
        parsed = bundle.parse_manifest(json.dumps(manifest).encode())
    except CheckFailed:
        return
    assert int(parsed["policy"]["version"]) > 0 and all(bundle.member_name_ok(n) for n in parsed["files"])
    assert all(len(m["sha256"]) == 64 and m["length"] >= 0 for m in parsed["files"].values())
    hashlib.sha256(bundle.manifest_bytes(parsed))  # serializable again
