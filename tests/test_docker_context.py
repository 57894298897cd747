"""The Jetson image's build context for every target, and `sim2edge package` without a Docker daemon."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge.errors import CheckFailed
from edge.targets import PROFILES
from stages.image import ImageConfig, jetson_context
from tests.bundles import make_bundle, make_keys
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.mark.parametrize("target", sorted(PROFILES))
def test_jetson_context_per_target(keys, target, tmp_path):
    make_bundle(tmp_path / "b.tar", keys[0], target=target, version="3")
    ctx = jetson_context(ImageConfig(), tmp_path / "b.tar", keys[1], tmp_path / "ctx")
    profile = PROFILES[target]
    assert ctx.target == target and ctx.tag == f"sim2edge-policy:tiny-3-{target}"
    assert ctx.build_args["BASE"] == profile.base_images[0]
    assert ctx.build_args["L4T_VERSION"] == ".".join(map(str, profile.l4t_min))
    names = sorted(str(p.relative_to(ctx.path)) for p in ctx.path.rglob("*") if p.is_file())
    assert {"Dockerfile", "bundle.tar", "trust.pub", "install_bundle.py", "edge/pyproject.toml", "edge/cli.py",
            "edge/smoke.py", ".dockerignore"} <= set(names)
    assert not any(n.endswith((".key", ".pyc")) for n in names), "no private key, no bytecode in the context"
    dockerfile = (ctx.path / "Dockerfile").read_text()
    for line in ("ARG BASE=", "FROM ${BASE}", "HEALTHCHECK", 'ENTRYPOINT ["sim2edge-agent", "run"'):
        assert line in dockerfile
    assert f"--build-arg BASE={profile.base_images[0]}" in ctx.command and "--platform linux/arm64" in ctx.command
    # the installer the image runs: verification passes, the target check then refuses this x86_64 host
    r = subprocess.run([sys.executable, str(ctx.path / "install_bundle.py"), str(ctx.path / "bundle.tar"), "--trust",
                        str(ctx.path / "trust.pub"), "--root", str(tmp_path / "store")],
                       capture_output=True, text=True, env={"L4T_VERSION": ctx.build_args["L4T_VERSION"],
                                                            "PYTHONPATH": str(ctx.path)})
    assert r.returncode == 2 and "bundle is for aarch64, device is" in r.stderr, r.stderr


def test_context_refuses_a_bundle_signed_by_another_key(keys, tmp_path):
    other = make_keys(tmp_path, "other")
    make_bundle(tmp_path / "b.tar", other[0])
    with pytest.raises(CheckFailed, match=r"^signature: manifest signature does not match any trusted key$"):
        jetson_context(ImageConfig(), tmp_path / "b.tar", keys[1], tmp_path / "ctx")
    assert not (tmp_path / "ctx").exists()


def test_package_cli_without_a_daemon_writes_the_context_and_the_command(keys, tmp_path):
    make_bundle(tmp_path / "b.tar", keys[0], target="orin-jp5.1")
    env = {"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock", "SIM2EDGE_HOME": str(tmp_path / "home")}
    r = run_cli("sim2edge", "package", str(tmp_path / "b.tar"), "--trust", str(keys[1]), "--image",
                "--registry", "127.0.0.1:5999", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no Docker daemon reachable" in r.stdout
    command = next(line for line in r.stdout.splitlines() if line.startswith("DOCKER_BUILDKIT=0 docker build"))
    assert "127.0.0.1:5999/sim2edge-policy:tiny-1-orin-jp5.1" in command
    assert (tmp_path / "b-image" / "Dockerfile").is_file() and command.endswith(str(tmp_path / "b-image"))
    bad = run_cli("sim2edge", "package", str(tmp_path / "missing.tar"), "--trust", str(keys[1]), env=env)
    assert bad.returncode == 2 and "missing.tar" in bad.stdout
