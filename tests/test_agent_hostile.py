"""The device agent against a registry that lies (tests/hostile_registry.py) and a real MLflow server with
edited tags: nothing the server says reaches the filesystem unchecked.

Every case runs the real console script and checks the same things: exit code 1 (refused) or 3
(unavailable), one line on stderr naming the check, a journaled refusal, no ``.part`` or staging
left, no file outside the store created, changed or deleted (a sibling directory is snapshotted
before and after), and an active ``current`` that still verifies.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from edge import bundle, signing
from edge.registry_answers import TAG_PATH, TAG_SHA256, TAG_SIZE
from edge.store import DeviceStore
from tests.bundles import GATE_FAILED, golden, make_bundle, make_keys, manifest, publish, tiny_onnx
from tests.hostile_registry import model_version

from tests.conftest import run_cli
from tests.agent_checks import PATH, agent, assert_refused, genuine, offer_tar, snapshot

# -- 1, 2: registry strings used as paths --------------------------------------------------------------------

SIBLING = "<sibling>"  # stands for the test's sibling directory in HOSTILE_ANSWERS (its path is known at run time)
_SHA = "a" * 64
# (name, answer fields, check) — each a value that once reached the filesystem or a bare exception
HOSTILE_ANSWERS = [
    ("absolute version", dict(version=SIBLING), "registry"),
    ("relative version", dict(version="../../sibling"), "registry"),
    ("version 0", dict(version="0"), "registry"),
    ("negative version", dict(version="-1"), "registry"),
    ("non-ascii digit version", dict(version="\u0663"), "registry"),
    ("version with newline", dict(version="2\n"), "registry"),
    ("version null", dict(version=None), "registry"),
    ("absolute sha256 tag", dict(sha256=SIBLING + "/x"), "registry"),
    ("relative sha256 tag", dict(sha256="../../sibling/x"), "registry"),
    ("uppercase sha256", dict(sha256=_SHA.upper()), "registry"),
    ("sha256 with newline", dict(sha256=_SHA + "\n"), "registry"),
    ("size -1", dict(size="-1"), "registry"),
    ("size abc", dict(size="abc"), "registry"),
    ("size 0 (empty bundle)", dict(size="0"), "registry"),
    ("size over the limit", dict(size=str(1 << 40)), "size"),
    ("absolute path", dict(path="/etc/passwd"), "registry"),
    ("dot-dot path", dict(path="1/../../etc/passwd"), "registry"),
    ("empty path component", dict(path="1//bundle.tar"), "registry"),
]


@pytest.mark.parametrize("name, fields, check", HOSTILE_ANSWERS, ids=[c[0] for c in HOSTILE_ANSWERS])
@pytest.mark.parametrize("with_active", [False, True], ids=["fresh", "active"])
def test_hostile_answer_fields_are_refused_before_any_use(tmp_path, keys, registry, sibling, name, fields, check,
                                                          with_active):
    fields = {k: v.replace(SIBLING, str(sibling)) if isinstance(v, str) else v for k, v in fields.items()}
    root = tmp_path / "store"
    if with_active:
        offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
        assert agent(registry, "pull", "tiny@champion", root, keys[1]).returncode == 0
    tar = genuine(tmp_path, keys[0], "2")
    offer_tar(registry, tar, **fields)
    before = snapshot(sibling)
    downloads = registry.downloads()
    r = agent(registry, "pull", "tiny@champion", root, keys[1])
    assert_refused(r, check, root, sibling, before, keys[1])
    assert registry.downloads() == downloads, name  # refused on the answer alone: nothing downloaded


def test_malformed_answers_are_refused_naming_the_field(tmp_path, keys, registry, sibling, active):
    before = snapshot(sibling)
    cases = [({"model_version": {"name": "other", "version": "2"}}, "asked for tiny, the registry answered model"),
             ({"model_version": {"name": "tiny", "version": "2", "tags": "x"}}, "tags of tiny v2"),
             ({"model_version": {"name": "tiny", "version": "2", "tags": [{"key": TAG_PATH}]}}, "tags of tiny v2"),
             ({"nothing": 1}, "has no model_version object"),
             ([1, 2], "JSON that is not an object"),
             (model_version("tiny", "2", PATH, "a" * 64, "10", run_id="../x"), "run_id of tiny v2")]
    for answer, words in cases:
        registry.offer(answer)
        r = agent(registry, "pull", "tiny@champion", active, keys[1])
        assert_refused(r, "registry", active, sibling, before, keys[1])
        assert words in r.stderr, r.stderr
    registry.offer(model_version("tiny", "3", PATH, "a" * 64, "10"))  # asked for v2, answered v3
    r = agent(registry, "pull", "tiny@2", active, keys[1])
    assert_refused(r, "registry", active, sibling, before, keys[1])
    assert "asked for tiny v2, the registry answered v3" in r.stderr


def test_edited_tags_on_a_real_mlflow_server_cannot_touch_files_outside_the_store(mlflow_server, tmp_path, keys,
                                                                                   sibling):
    """Editing one model-version tag needs no signing key: it must not let a device write or delete anything."""
    from mlflow.tracking import MlflowClient

    name = f"tiny-{os.urandom(4).hex()}"
    for v in ("1", "2"):
        make_bundle(tmp_path / f"{v}.tar", keys[0], version=v, name=name)
        publish(mlflow_server, tmp_path / f"{v}.tar", name, "champion")
    root = tmp_path / "store"
    pull = ("sim2edge-agent", "pull", f"{name}@1", "--registry", mlflow_server, "--root", str(root), "--trust",
            str(keys[1]), "--skip-target-check", "--attempts", "1", "--backoff", "0", "--ignore-backoff")
    assert run_cli(*pull).returncode == 0
    client = MlflowClient(mlflow_server)
    before = snapshot(sibling)
    for version, tag, value in (("1", TAG_SHA256, str(sibling / "x")),  # the alias on the active version
                                ("2", TAG_SHA256, str(sibling / "x")),
                                ("2", TAG_SHA256, "../../sibling/keep.txt"),
                                ("2", TAG_SIZE, "-1"),
                                ("2", TAG_PATH, "/etc/passwd")):
        good = client.get_model_version(name, version).tags[tag]
        client.set_model_version_tag(name, version, tag, value)
        client.set_registered_model_alias(name, "champion", version)
        r = run_cli(*[a if a != f"{name}@1" else f"{name}@champion" for a in pull])
        assert_refused(r, "registry", root, sibling, before, keys[1])
        assert tag in r.stderr, r.stderr
        client.set_model_version_tag(name, version, tag, good)
    assert (sibling / "x.part").read_bytes() == b"partial"
    r = run_cli(*[a if a != f"{name}@1" else f"{name}@champion" for a in pull])  # tags mended: v2 installs
    assert r.returncode == 0 and DeviceStore(root).current_manifest()["policy"]["version"] == "2", r.stderr


# -- 3, 5, 7: unpacked before authenticated; malformed signed manifests; odd member names ------------------------

def signed_tar(priv: Path, members: list, listed: dict | None = None, edit=None, fmt=tarfile.GNU_FORMAT) -> bytes:
    """A tar of ``members`` ((name, bytes), in order) with a manifest signed by ``priv`` listing ``listed``
    (default: every member), optionally edited by ``edit(manifest)`` before signing."""
    listed = dict(members) if listed is None else listed
    full = dict(manifest(version="2"), format=bundle.FORMAT, format_version=bundle.FORMAT_VERSION,
                files={n: {"sha256": hashlib.sha256(b).hexdigest(), "length": len(b)} for n, b in listed.items()})
    if edit:
        edit(full)
    body = bundle.manifest_bytes(full)
    sig = signing.load_private(priv).sign(body)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in [(bundle.MANIFEST, body), (bundle.SIGNATURE, sig), *members]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def good_members() -> list:
    return [("golden.npz", golden()), ("policy.onnx", tiny_onnx())]


def drop(*path):
    def edit(m):
        for key in path[:-1]:
            m = m[key]
        del m[path[-1]]
    return edit


def put(value, *path):
    def edit(m):
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value
    return edit


LONG_NAME = "p" * 300
HOSTILE_TARS = [  # (name, build(priv, good, big) -> tar bytes, check, words): archives a trusted key signed,
    # or that are not what they claim; ``good`` is good_members(), ``big`` 8 MiB
    ("unlisted 8 MiB member first", lambda priv, good, big: signed_tar(priv, [("big.bin", big), *good], dict(good)),
     "files", "extra file"),
    ("listed member longer than signed",
     lambda priv, good, big: signed_tar(priv, [("golden.npz", golden()), ("policy.onnx", big)], dict(good)),
     "length", "'policy.onnx' is"),
    ("manifest without policy", lambda priv, good, big: signed_tar(priv, good, edit=drop("policy")),
     "manifest", "policy is missing"),
    ("files entry without length",
     lambda priv, good, big: signed_tar(priv, good, edit=drop("files", "policy.onnx", "length")),
     "manifest", "files.policy.onnx.length"),
    ("length as text", lambda priv, good, big: signed_tar(priv, good, edit=put("12", "files", "policy.onnx", "length")),
     "manifest", "files.policy.onnx.length"),
    ("no control period", lambda priv, good, big: signed_tar(priv, good, edit=drop("control")), "manifest", "control"),
    ("negative tolerance",
     lambda priv, good, big: signed_tar(priv, good, edit=put(-1, "parity_tolerance", "fp32", "atol")),
     "manifest", "parity_tolerance.fp32.atol"),
    ("signed version is not a number",
     lambda priv, good, big: signed_tar(priv, good, edit=put("../x", "policy", "version")),
     "manifest", "policy.version"),
    ("300-character member name", lambda priv, good, big: signed_tar(priv, [*good, (LONG_NAME, b"x")], dict(good)),
     "archive", "member path"),
    ("'engines' then 'engines/x.plan'",
     lambda priv, good, big: signed_tar(priv, [*good, ("engines", b"x"), ("engines/x.plan", b"y")], dict(good)),
     "archive", "member path 'engines'"),
    ("'engines/x.plan' then 'engines'",
     lambda priv, good, big: signed_tar(priv, [*good, ("engines/x.plan", b"y"), ("engines", b"x")], dict(good)),
     "archive", "member path 'engines'"),
    ("member name with a trailing newline",
     lambda priv, good, big: signed_tar(priv, [good[0], ("policy.onnx\n", tiny_onnx())], dict(good)),
     "archive", "member path 'policy.onnx\\n'"),
    ("not a tar", lambda priv, good, big: b"\x00garbage" * 200, "archive", "not a readable tar"),
]


@pytest.mark.parametrize("name, build, check, words", HOSTILE_TARS, ids=[c[0] for c in HOSTILE_TARS])
def test_hostile_archives_are_refused_before_anything_is_unpacked(tmp_path, keys, registry, sibling, active, name,
                                                                  build, check, words):
    offer_tar(registry, build(keys[0], good_members(), b"\x01" * (8 << 20)))
    before = snapshot(sibling)
    # the agent dies at its first extracted member if it gets that far: a refusal (exit 1) proves none was
    r = agent(registry, "pull", "tiny@champion", active, keys[1], env={"SIM2EDGE_AGENT_KILL_AT": "extract"})
    assert_refused(r, check, active, sibling, before, keys[1])
    assert words in r.stderr, (name, r.stderr)


def test_twenty_thousand_members_are_refused_at_once(tmp_path, keys, registry, sibling, active):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for i in range(20_000):
            t.addfile(tarfile.TarInfo(f"m{i}"), io.BytesIO(b""))
    offer_tar(registry, buf.getvalue())
    before = snapshot(sibling)
    start = time.monotonic()
    r = agent(registry, "pull", "tiny@champion", active, keys[1])
    assert_refused(r, "archive", active, sibling, before, keys[1])
    assert f"more than {bundle.MAX_MEMBERS} members" in r.stderr
    assert time.monotonic() - start < 5.0  # was 10-30 s: every member created and fsynced first


def test_empty_and_truncated_bodies_are_refused(tmp_path, keys, registry, sibling, active):
    before = snapshot(sibling)
    empty = hashlib.sha256(b"").hexdigest()
    registry.offer(model_version("tiny", "2", PATH, empty, "0"), b"")
    r = agent(registry, "pull", "tiny@champion", active, keys[1])
    assert_refused(r, "registry", active, sibling, before, keys[1])
    assert "declares an empty bundle" in r.stderr
    tar = genuine(tmp_path, keys[0], "2")
    offer_tar(registry, tar)
    registry.body = b""  # declared 10 KiB, sends nothing
    r = agent(registry, "pull", "tiny@champion", active, keys[1])
    assert_refused(r, "size", active, sibling, before, keys[1])
    assert "stayed truncated" in r.stderr


# -- 4: no overall deadline ------------------------------------------------------------------------------------

def test_a_dripping_registry_meets_the_deadline_and_releases_the_lock(tmp_path, keys, registry, sibling, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    registry.drip_s = 0.05  # 20 bytes/s: under any per-read timeout, 10 KiB would take 8 minutes
    before = snapshot(sibling)
    args = [str(Path(sys.executable).parent / "sim2edge-agent"), "pull", "tiny@champion", "--registry", registry.url,
            "--root", str(active), "--trust", str(keys[1]), "--skip-target-check", "--timeout", "2", "--attempts",
            "2", "--deadline", "3", "--min-rate", "1e9", "--backoff", "0", "--ignore-backoff"]
    start = time.monotonic()
    slow = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    busy = run_cli("sim2edge-agent", "gc", "--root", str(active))  # the pull holds the store's lock meanwhile
    out, err = slow.communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert busy.returncode == 3 and "lock:" in busy.stderr, busy.stderr
    r = subprocess.CompletedProcess(args, slow.returncode, out, err)
    assert_refused(r, "deadline", active, sibling, before, keys[1], code=3)
    assert elapsed < 10, elapsed
    assert run_cli("sim2edge-agent", "gc", "--root", str(active)).returncode == 0  # released
    part = list((active / "downloads").glob("*.part"))
    assert part == [] or part[0].stat().st_size < 200  # what arrived may be kept for a resume, nothing more


def test_a_registry_dripping_its_headers_meets_the_resolve_deadline(tmp_path, keys, registry, sibling, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    registry.drip_s, registry.drip_headers = 0.2, True
    before = snapshot(sibling)
    start = time.monotonic()
    r = agent(registry, "pull", "tiny@champion", active, keys[1], "--timeout", "2", "--deadline", "2")
    assert_refused(r, "deadline", active, sibling, before, keys[1], code=3)
    assert time.monotonic() - start < 8


# -- 6: known-bad and the trusted keys ---------------------------------------------------------------------------

def test_a_wrong_trust_key_does_not_mark_the_genuine_version_bad_for_the_right_one(tmp_path, keys, registry, sibling,
                                                                                  active):
    other = make_keys(tmp_path, "other")
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@champion", active, other[1])
    assert_refused(r, "signature", active, sibling, before, keys[1])  # current (signed by keys) still verifies
    entry = DeviceStore(active).failed_versions()["tiny/2"]
    assert entry["check"] == "signature" and entry["trusted_keys"] == signing.key_ids(signing.load_trusted([other[1]]))
    downloads = registry.downloads()
    r = agent(registry, "pull", "tiny@champion", active, other[1])
    assert_refused(r, "known-bad", active, sibling, before, keys[1])
    assert registry.downloads() == downloads
    r = agent(registry, "pull", "tiny@champion", active, keys[1])  # the right key: tried again, no --retry-failed
    assert r.returncode == 0 and DeviceStore(active).current_manifest()["policy"]["version"] == "2", r.stderr


def test_watch_retry_failed_tries_a_known_bad_version_once(tmp_path, keys, registry, sibling, active):
    bad = genuine(tmp_path, keys[0], "2", files={"policy.onnx": tiny_onnx(), "golden.npz": golden(0.9)})
    offer_tar(registry, bad)
    assert agent(registry, "pull", "tiny@champion", active, keys[1]).returncode == 1  # smoke test fails
    downloads = registry.downloads()
    watch = ("--interval", "0", "--no-report")
    r = agent(registry, "watch", "tiny@champion", active, keys[1], *watch, "--iterations", "2")
    assert registry.downloads() == downloads and "known-bad" in r.stderr, r.stderr
    r = agent(registry, "watch", "tiny@champion", active, keys[1], *watch, "--iterations", "2", "--retry-failed")
    assert registry.downloads() == downloads + 1, r.stderr  # the first poll retried, the second did not
    assert DeviceStore(active).failed_versions()["tiny/2"]["count"] == 2


# -- a challenger's bundle ---------------------------------------------------------------------------------------

def test_a_bundle_that_failed_its_gate_needs_allow_failed_gate(tmp_path, keys, registry, sibling, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2", evaluation=GATE_FAILED))  # as the packager writes it
    before = snapshot(sibling)
    r = agent(registry, "pull", "tiny@challenger", active, keys[1])
    assert_refused(r, "gate", active, sibling, before, keys[1])
    assert "failed its evaluation gate" in r.stderr and "--allow-failed-gate" in r.stderr
    r = agent(registry, "pull", "tiny@challenger", active, keys[1], "--allow-failed-gate")
    assert r.returncode == 0 and DeviceStore(active).current_manifest()["policy"]["version"] == "2", r.stderr


# -- the same hardening for repair and upload -------------------------------------------------------------------

def test_repair_refuses_hostile_answers(tmp_path, keys, registry, sibling, active):
    offer_tar(registry, genuine(tmp_path, keys[0], "2"))
    assert agent(registry, "pull", "tiny@champion", active, keys[1]).returncode == 0
    v1 = active / "bundles" / "tiny" / "1"
    (v1 / "golden.npz").chmod(0o600)
    (v1 / "golden.npz").write_bytes(b"rot")  # `previous` went bad on disk
    before = snapshot(sibling)
    for fields in (dict(version="1", sha256=str(sibling / "x")), dict(version="9"), dict(version="1", size="-1")):
        offer_tar(registry, genuine(tmp_path, keys[0], "1"), **fields)
        r = run_cli("sim2edge-agent", "repair", "--registry", registry.url, "--root", str(active), "--trust",
                    str(keys[1]), "--attempts", "1")
        assert r.returncode == 1 and "not repaired: tiny v1: registry:" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and snapshot(sibling) == before
        assert DeviceStore(active).history()[-1]["event"] == "repair-failed"
    offer_tar(registry, genuine(tmp_path, keys[0], "1"), version="1")
    r = run_cli("sim2edge-agent", "repair", "--registry", registry.url, "--root", str(active), "--trust", str(keys[1]))
    assert r.returncode == 0 and "repaired tiny v1" in r.stdout, r.stderr


def test_upload_refuses_hostile_answers(tmp_path, registry, sibling, active):
    pending = active / "telemetry" / "pending"
    pending.mkdir(parents=True)
    (pending / "t-0-v1.npz").write_bytes(b"x")
    before = snapshot(sibling)
    for answer, field in (({"experiment": {"experiment_id": "../../x"}}, "experiment.experiment_id"),
                          ({"experiment": "x"}, "experiment.experiment_id")):
        registry.routes = {"/api/2.0/mlflow/experiments/get-by-name": answer}
        r = run_cli("sim2edge-agent", "upload", "--registry", registry.url, "--root", str(active), "--task",
                    "cartpole", "--attempts", "1")
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
        assert field in r.stderr and "Traceback" not in r.stderr
    registry.routes = {"/api/2.0/mlflow/experiments/get-by-name": {"experiment": {"experiment_id": "1"}},
                       "/api/2.0/mlflow/runs/create": {"run": {"info": {"run_id": "r1",
                                                                        "artifact_uri": "mlflow-artifacts:/../../x"}}}}
    r = run_cli("sim2edge-agent", "upload", "--registry", registry.url, "--root", str(active), "--task", "cartpole",
                "--attempts", "1")
    assert r.returncode == 1 and "run.info.artifact_uri" in r.stderr, r.stderr
    assert snapshot(sibling) == before and (pending / "t-0-v1.npz").exists()
