"""Bundles from a real export for every target profile, verified by the device agent's own checks; the bundle is
deterministic; signing keys come from a file or SIM2EDGE_SIGNING_KEY and never end up in an artifact or a log."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization

from edge import bundle, signing
from edge.errors import CheckFailed
from edge.smoke import smoke_test
from edge.targets import PROFILES, check_compatible, detect_device, load_target
from stages.export import ExportConfig, export
from stages.io_spec import IOSpec
from stages.package import PackageConfig, build_manifest, package
from stages.sim.params import PhysicalParams
from stages.sim.registry import load
from stages.train import train
from stages.train_config import TrainConfig
from tests.bundles import linear_onnx
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The pipeline's own export of a 2-iteration cart-pole policy."""
    tmp = tmp_path_factory.mktemp("targets")
    ckpt = train(TrainConfig(iterations=2, num_envs=8, steps_per_env=8, hidden_dims=(16, 16)), PhysicalParams(),
                 tmp / "checkpoint")
    return export(ExportConfig(parity_samples=1000), ckpt, tmp / "onnx")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    signing.generate_keypair(d / "signing.key", d / "signing.pub")
    return d


def make(exported, keys, target, out, version="1"):
    cfg = PackageConfig(target=target)
    manifest = build_manifest(cfg, "cartpole", version, exported, IOSpec.from_task(load("cartpole")),
                              {"mlflow_run_id": "test"}, {"passed": True})
    return package(cfg, manifest, exported, keys, out)


@pytest.mark.parametrize("target", sorted(PROFILES))
def test_bundle_per_target_passes_the_agents_verifier(exported, keys, target, tmp_path, monkeypatch):
    art = make(exported, keys, target, tmp_path / f"{target}.tar")
    (tmp_path / "x").mkdir()
    bundle.extract(art.path, tmp_path / "x", 1 << 26)
    manifest = bundle.verify_dir(tmp_path / "x", signing.load_trusted([keys / "signing.pub"]))
    profile = load_target(manifest["target"]["name"])
    assert manifest["target"]["tensorrt"] == profile.tensorrt and manifest["target"]["opset"] <= profile.max_opset
    # the agent's detection with the container override (L4T_VERSION); this x86_64 host stands in for aarch64
    monkeypatch.setenv("L4T_VERSION", ".".join(map(str, profile.l4t_min)))
    device = dataclasses.replace(detect_device(), arch="aarch64")
    check_compatible(profile, device)
    for other in PROFILES.values():  # and a device of another JetPack refuses this bundle
        if not profile.l4t_min <= other.l4t_min < profile.l4t_max:
            with pytest.raises(CheckFailed, match="target: bundle is for " + profile.name):
                check_compatible(profile, dataclasses.replace(device, l4t=other.l4t_min))
    assert smoke_test(tmp_path / "x", manifest).max_abs_error <= manifest["parity_tolerance"]["fp32"]["atol"]


def test_same_inputs_same_bundle_bytes(exported, keys, tmp_path):
    a = make(exported, keys, "orin-jp6.2", tmp_path / "a.tar")
    b = make(exported, keys, "orin-jp6.2", tmp_path / "b" / "again.tar")
    assert a.digest == b.digest == hashlib.sha256(a.path.read_bytes()).hexdigest()
    assert a.path.read_bytes() == b.path.read_bytes()
    c = make(exported, keys, "orin-jp6.2", tmp_path / "c.tar", version="2")
    assert c.digest != a.digest, "a different manifest must change the digest"


def private_forms(pem: bytes) -> list[bytes]:
    """Every encoding of the private key a leak could take: PEM, its base64 body, raw bytes, hex."""
    key = serialization.load_pem_private_key(pem, password=None)
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    body = b"".join(pem.split(b"\n")[1:-2])
    return [pem, body, body[:40], raw, raw.hex().encode(), base64.b64encode(raw)]


def test_keys_cli_and_the_private_key_never_leaks(tmp_path):
    gen = run_cli("sim2edge", "keys", "generate", "--out", str(tmp_path / "k"))
    assert gen.returncode == 0, gen.stdout + gen.stderr
    again = run_cli("sim2edge", "keys", "generate", "--out", str(tmp_path / "k"))
    assert again.returncode == 2 and "exists" in again.stdout
    pem = (tmp_path / "k" / "signing.key").read_bytes()
    public = run_cli("sim2edge", "keys", "public", "--key", str(tmp_path / "k" / "signing.key"))
    assert public.stdout.encode() == (tmp_path / "k" / "signing.pub").read_bytes()

    spec = tmp_path / "io.json"
    spec.write_text(IOSpec.from_task(load("cartpole")).model_dump_json())
    onnx_src = tmp_path / "policy.onnx"
    onnx_src.write_bytes(linear_onnx(np.full((5, 1), 0.3, np.float32)))
    env = {"SIM2EDGE_HOME": str(tmp_path / "home"), "SIM2EDGE_SIGNING_KEY": pem.decode()}  # the PEM itself, as CI has it
    imported = run_cli("sim2edge", "import", str(onnx_src), "--spec", str(spec), "--out", str(tmp_path / "out"), env=env)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    pub_env = run_cli("sim2edge", "keys", "public", env=env)
    assert pub_env.stdout.encode() == (tmp_path / "k" / "signing.pub").read_bytes()
    bad = run_cli("sim2edge", "keys", "public", env={**env, "SIM2EDGE_SIGNING_KEY": pem.decode()[:-40]})
    assert bad.returncode == 2 and "SIM2EDGE_SIGNING_KEY (PEM text): not a readable" in bad.stdout

    (tmp_path / "x").mkdir()
    bundle.extract(tmp_path / "out" / "bundle.tar", tmp_path / "x", 1 << 24)
    bundle.verify_dir(tmp_path / "x", signing.load_trusted([tmp_path / "k" / "signing.pub"]))
    blobs = {"cli output": b"".join(r.stdout.encode() + r.stderr.encode() for r in (gen, public, imported, pub_env, bad))}
    for root in (tmp_path / "out", tmp_path / "x", tmp_path / "home"):
        blobs.update({str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()})
    assert any("bundle.tar" in name for name in blobs) and any("manifest.json" in name for name in blobs)
    for name, data in blobs.items():
        for form in private_forms(pem):
            assert form not in data, f"private key material found in {name}"


def test_polygraphy_repeats_the_build_hosts_comparison_from_the_bundle(exported, keys, tmp_path):
    """`polygraphy run --onnxrt --load-inputs/--load-outputs` (what a device runs with --trt) on the bundle's files."""
    from polygraphy.comparator import RunResults

    art = make(exported, keys, "orin-jp6.1", tmp_path / "b.tar")
    x = tmp_path / "x"
    x.mkdir()
    bundle.extract(art.path, x, 1 << 26)
    manifest = bundle.verify_dir(x, signing.load_trusted([keys / "signing.pub"]))
    assert {"polygraphy_inputs.json", "polygraphy_outputs.json"} <= set(manifest["files"])
    polygraphy = shutil.which("polygraphy", path=str(Path(sys.executable).parent))

    def compare(outputs: Path):
        return subprocess.run([polygraphy, "run", str(x / "policy.onnx"), "--onnxrt", "--load-inputs",
                               str(x / "polygraphy_inputs.json"), "--load-outputs", str(outputs), "--atol", "1e-5",
                               "--rtol", "1e-4"], capture_output=True, text=True, timeout=300)

    ok = compare(x / "polygraphy_outputs.json")
    assert ok.returncode == 0 and "PASSED" in ok.stdout + ok.stderr, ok.stdout[-2000:] + ok.stderr[-2000:]
    results = RunResults.load(str(x / "polygraphy_outputs.json"))
    for _, iterations in results:
        for it in iterations:
            for name in it.keys():
                it[name] = it[name] + 0.5  # a reference the model does not reproduce
    results.save(str(tmp_path / "wrong.json"))
    bad = compare(tmp_path / "wrong.json")
    assert bad.returncode != 0 and "FAILED" in bad.stdout + bad.stderr
    json.loads((x / "polygraphy_inputs.json").read_text())  # plain JSON a device can read without polygraphy
