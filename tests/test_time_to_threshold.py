"""benchmarks/time_to_threshold.py --quick: curves written per side, the floor ratio and the SB3 ratio printed."""

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_time_to_threshold(tmp_path):
    pytest.importorskip("stable_baselines3")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_threshold.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    for side in ("sim2edge", "sb3"):
        rows = list(csv.DictReader((tmp_path / f"{side}_seed0.csv").open()))
        assert rows, side
        times = [float(r["train_s"]) for r in rows]
        steps = [int(r["env_steps"]) for r in rows]
        assert times == sorted(times) and steps == sorted(steps) and times[0] > 0, side
        assert all(math.isfinite(float(r["eval_return"])) for r in rows), side
    assert re.search(r"sim2edge / floor \d+\.\d×", run.stdout), run.stdout
    assert re.search(r"SB3 / sim2edge \d+\.\d×", run.stdout), run.stdout
