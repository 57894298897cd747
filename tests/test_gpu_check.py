"""benchmarks/gpu_check.py, the GPU machine's one prepared script, run here on the CPU against itself so that it
works when a GPU is lent (the wheel set it installs there was checked once against a CPU-only torch; see
docs/status.md)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gpu_check


def test_every_step_of_the_gpu_check_runs_on_the_cpu(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "gpu_check.json")])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == json.loads(json.dumps(report))
    assert report["machine"]["torch"] == torch.__version__ and "CPUExecutionProvider" in report["machine"]["providers"]
    assert set(report["update"]) == set(gpu_check.QUICK_SIZES)
    for r in report["update"].values():
        assert r["cpu_ms"] > 0 and r["speedup"] == 1.0  # the CPU against itself: one measurement
    assert math.isfinite(report["train"]["cpu"]["eval_return"]) and 0 < report["train"]["cpu"]["collect_share"] < 1
    assert report["export"]["parity_max_abs_error"] < 1e-5
    assert report["export"]["latency_batch1"]["CPUExecutionProvider"]["p50_us"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_a_missing_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit, match=r"^gpu_check: train.device 'cuda': torch .* sees no CUDA device here"):
        gpu_check.main(["--device", "cuda"])
