"""The device agent installs alone and verifies + smoke-tests a bundle on each JetPack Python."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bundles import make_bundle, make_keys

REPO = Path(__file__).resolve().parents[1]
JETPACK_PYTHONS = {"3.8": "JetPack 5", "3.10": "JetPack 6", "3.12": "JetPack 7"}
CHECK = """
import sys, tempfile, pathlib
from edge import bundle, signing, smoke, policy, cli, pull
tar, pub = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
d = pathlib.Path(tempfile.mkdtemp())
bundle.extract(tar, d, 1 << 24)
m = bundle.verify_dir(d, signing.load_trusted([pub]))
r = smoke.smoke_test(d, m)
print("ok", sys.version_info[:2], r.runtime, r.max_abs_error)
"""


def interpreter(version: str) -> str | None:
    root = os.environ.get("PYENV_ROOT") or (subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
                                             if shutil.which("pyenv") else "")
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}")) if root else []
    return found[-1] if found else shutil.which(f"python{version}")


def edge_venv(version: str) -> Path:
    """A venv with only ``edge/`` (and its declared dependencies) installed; reused across runs."""
    python = interpreter(version)
    if python is None:
        pytest.skip(f"CPython {version} ({JETPACK_PYTHONS[version]}) is not installed here")
    venv = REPO / ".venv-edge" / version
    stamp = venv / ".installed"
    source = sorted((REPO / "edge").glob("*.py")) + [REPO / "edge" / "pyproject.toml"]
    if not stamp.exists() or any(p.stat().st_mtime > stamp.stat().st_mtime for p in source):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        build = Path(os.environ.get("TMPDIR", "/tmp")) / f"edge-build-{version}"
        shutil.rmtree(build, ignore_errors=True)
        shutil.copytree(REPO / "edge", build, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{build}[mqtt,mcap]"], check=True)
        stamp.touch()
    return venv


@pytest.mark.device
@pytest.mark.parametrize("version", [pytest.param(v, marks=pytest.mark.slow) if v == "3.12" else v
                                     for v in sorted(JETPACK_PYTHONS)])  # JetPack 7's in the slow run
def test_agent_runs_on_jetpack_python(version, tmp_path):
    venv = edge_venv(version)
    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv)
    python = str(venv / "bin" / "python")
    out = subprocess.run([python, "-W", "ignore", "-c", CHECK, str(tmp_path / "b.tar"), str(pub)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok") and "onnxruntime" in out.stdout
    # the installed agent is self-contained: nothing of the pipeline is importable there
    leak = subprocess.run([python, "-c", "import stages"], capture_output=True, text=True, cwd=tmp_path)
    assert leak.returncode != 0
    cli = subprocess.run([str(venv / "bin" / "sim2edge-agent"), "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "pull" in cli.stdout


def test_edge_source_is_python38_compatible():
    vermin = Path(sys.executable).parent / "vermin"
    out = subprocess.run([str(vermin), "-t=3.8-", "--eval-annotations", "--no-tips", "--violations", str(REPO / "edge")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
