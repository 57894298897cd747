"""tests/ci_skips.py, run by pytest itself on a throwaway test file: which skips fail under ``CI=true``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SKIPS = '''
import pytest

def test_browser():
    pytest.skip("chromium is not installed")

@pytest.mark.skipif(True, reason="needs strace")
def test_strace():
    pass

def test_daemon():
    pytest.skip("dockerd did not start within 60 s")

def test_tensorrt():
    pytest.skip("TensorRT is not installed")
'''


def run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_skips.py").write_text(SKIPS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "tests.ci_skips",
                           str(tmp_path / "test_skips.py")], capture_output=True, text=True, cwd=tmp_path, env=env)


def test_skips_for_provided_capabilities_fail_under_ci(tmp_path):
    r = run(tmp_path, "true")
    assert r.returncode == 1, r.stdout
    assert "2 failed, 1 skipped, 1 error" in r.stdout, r.stdout  # a skipif mark skips at setup: an error there
    assert "skipped under CI, but this machine can provide it: dockerd did not start" in r.stdout
    assert "SKIPPED [1] test_skips.py" in r.stdout and ": TensorRT is not installed" in r.stdout


def test_outside_ci_every_skip_stays_a_skip_and_says_why(tmp_path):
    r = run(tmp_path, None)
    assert r.returncode == 0 and "4 skipped" in r.stdout, r.stdout
    assert "chromium is not installed" in r.stdout and "needs strace" in r.stdout
