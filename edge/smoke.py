"""The smoke test: golden outputs within tolerance and latency within the control period."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from edge.errors import CheckFailed
from edge.runtime import select_runtime


@dataclass(frozen=True)
class SmokeResult:
    runtime: str
    max_abs_error: float
    latency_p50_s: float
    latency_p99_s: float


def tolerance(runtime, manifest: dict) -> dict:
    """The manifest's parity tolerance for this runtime's precision (FP16 engines: the looser one)."""
    return manifest["parity_tolerance"][runtime.key.precision if runtime.name == "tensorrt" else "fp32"]


def smoke_test(bundle_dir: Path, manifest: dict, iterations: int = 200, engines_dir: Optional[Path] = None) -> SmokeResult:
    """Run the bundle's golden inputs and a latency loop; raise :class:`CheckFailed` on failure.

    ``engines_dir``: the device's TensorRT engine cache; a missing engine is built there (where TensorRT runs)."""
    selection = select_runtime(bundle_dir / "policy.onnx", manifest, engines_dir,  # TensorRT → ORT CUDA → ORT CPU
                               build_engines=engines_dir is not None)
    runtime = selection.runtime
    golden = np.load(bundle_dir / "golden.npz")
    inputs = golden["inputs"].astype(np.float32)
    fixed = manifest.get("io", {}).get("input", {}).get("shape", [-1])[0]  # a graph with a fixed batch (e.g. 1)
    step = fixed if isinstance(fixed, int) and fixed > 0 else len(inputs)
    out = np.concatenate([runtime.run(inputs[i:i + step]) for i in range(0, len(inputs), step)])
    if out.shape != golden["outputs"].shape:
        raise CheckFailed("smoke", f"output shape {out.shape} != golden {golden['outputs'].shape}")
    err = float(np.max(np.abs(out - golden["outputs"])))
    tol = tolerance(runtime, manifest)
    if not err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(golden["outputs"]))):
        raise CheckFailed("smoke", f"golden outputs differ by {err:.3g} (tolerance atol {tol['atol']}, rtol {tol['rtol']})")
    one = golden["inputs"][:1].astype(np.float32)
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        runtime.run(one)
        times.append(time.perf_counter() - start)
    p50, p99 = (float(np.percentile(times, q)) for q in (50, 99))
    period = manifest["control"]["period_s"]
    if p99 > period:
        raise CheckFailed("latency", f"inference p99 {p99 * 1e3:.2f} ms exceeds the control period {period * 1e3:.1f} ms")
    return SmokeResult(selection.describe(), err, p50, p99)


def main() -> int:
    """``python3 -m edge.smoke --root STORE``: the smoke test of the active bundle (exit 0 pass, 1 fail), e.g. for a
    container HEALTHCHECK; run ``sim2edge-agent verify`` first to check its signature."""
    p = argparse.ArgumentParser(prog="python3 -m edge.smoke", description=main.__doc__)
    p.add_argument("--root", type=Path, required=True, help="device store")
    args = p.parse_args()
    current = args.root / "current"
    try:
        result = smoke_test(current, json.loads((current / "manifest.json").read_text()), engines_dir=args.root / "engines")
    except (CheckFailed, OSError, ValueError, KeyError) as e:
        print(f"smoke: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"smoke: ok on {result.runtime}, max error {result.max_abs_error:.2g}, p99 {result.latency_p99_s * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
