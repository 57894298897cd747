"""Export: torch actor → ONNX with normalization and the deterministic action in the graph.

The exported graph maps raw observations (B, obs_dim) to actuator controls (B, act_dim):
``default + scale * clip(mlp(normalize(obs)), -1, 1)``. Parity against torch is checked
with ONNX Runtime through the device's own runtime code (``edge.runtime``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from pydantic import BaseModel, ConfigDict, Field

from edge.bundle import sha256_path
from edge.runtime import OnnxRuntime
from stages.artifacts import Checkpoint, ExportedPolicy, atomic_dir
from stages.sim.registry import load
from stages.train import load_actor

INPUT, OUTPUT = "obs", "action"


class ExportConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    opset: int = Field(17, ge=13, description="ONNX opset (17 parses on TensorRT 8.5 to 10.x).")
    parity_samples: int = Field(1000, ge=10, description="Random inputs in the parity check.")
    atol: float = Field(1e-5, gt=0)
    rtol: float = Field(1e-4, ge=0)
    golden_samples: int = Field(64, ge=1, description="Inputs recorded with reference outputs for the device.")
    seed: int = 0


class ParityError(RuntimeError):
    """ONNX Runtime disagrees with torch beyond tolerance."""


class DeployedActor(torch.nn.Module):
    """Normalizer + MLP + deterministic action, then clipping and scaling to actuator units."""

    def __init__(self, inner: torch.nn.Module, scale: np.ndarray, default: np.ndarray) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.register_buffer("default", torch.as_tensor(default, dtype=torch.float32))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.default + self.scale * torch.clamp(self.inner(obs), -1.0, 1.0)


def parity_inputs(mean: np.ndarray, std: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """In-distribution samples, far out-of-distribution samples (±10σ), zeros and extremes."""
    k = n // 2
    inside = mean + std * rng.standard_normal((k, len(mean)))
    outside = mean + 10 * std * rng.uniform(-1, 1, (n - k - 3, len(mean)))
    edges = np.stack([np.zeros_like(mean), mean + 1e3 * std, mean - 1e3 * std])
    return np.concatenate([inside, outside, edges]).astype(np.float32)


def export(cfg: ExportConfig, checkpoint: Checkpoint, out_dir: Path) -> ExportedPolicy:
    """Write ``policy.onnx`` and ``golden.npz`` into ``out_dir``; raise ParityError on mismatch."""
    task = load(checkpoint.task)
    actor = load_actor(checkpoint.path)
    module = DeployedActor(actor.as_onnx(verbose=False), task.action_scale, task.action_default).eval()
    normalizer = actor.obs_normalizer
    return export_module(cfg, module, normalizer.mean.numpy(), normalizer.std.numpy(), checkpoint.task, out_dir)


def export_module(cfg: ExportConfig, module: torch.nn.Module, mean: np.ndarray, std: np.ndarray, task: str,
                  out_dir: Path) -> ExportedPolicy:
    """Export ``module`` ((B, obs) → (B, act) in actuator units) and check it against torch on parity inputs
    drawn around the observation statistics ``mean``/``std``."""
    rng = np.random.default_rng(cfg.seed)
    with atomic_dir(out_dir) as tmp:
        onnx_path = tmp / "policy.onnx"
        batch = torch.export.Dim("batch", min=1, max=65536)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (torch.zeros(2, len(mean)),), str(onnx_path), opset_version=cfg.opset,
                              input_names=[INPUT], output_names=[OUTPUT], dynamic_shapes=({0: batch},),
                              dynamo=True, external_data=False, verbose=False)
        onnx.checker.check_model(onnx.load(str(onnx_path)), full_check=True)
        x = parity_inputs(mean, std, cfg.parity_samples, rng)
        with torch.no_grad():
            expected = module(torch.from_numpy(x)).numpy()
        err = check_parity(cfg, "torch", expected, OnnxRuntime(onnx_path).run(x), x)
        np.savez(tmp / "golden.npz", inputs=x[: cfg.golden_samples], outputs=expected[: cfg.golden_samples])
    return ExportedPolicy(path=out_dir / "policy.onnx", digest=sha256_path(out_dir / "policy.onnx"), task=task,
                          opset=cfg.opset, parity_max_abs_error=err, golden=out_dir / "golden.npz")


def check_parity(cfg: ExportConfig, reference: str, expected: np.ndarray, got: np.ndarray, x: np.ndarray) -> float:
    """Max |got - expected| elementwise within atol + rtol·|expected|; else ParityError with the worst input."""
    err = np.abs(got - expected)
    if not np.all(err <= cfg.atol + cfg.rtol * np.abs(expected)):
        worst = int(np.argmax(err.max(axis=1)))
        raise ParityError(f"ONNX Runtime vs {reference}: max error {err.max():.3g} > tolerance "
                          f"(atol {cfg.atol}, rtol {cfg.rtol}) at input {x[worst].tolist()}")
    return float(err.max())


def build_engines(exported: ExportedPolicy, cache_dir: Path, precisions: tuple[str, ...] = ("fp16",),
                  dla_core: int | None = None) -> list[Path]:
    """On a GPU build host that matches the target: TensorRT plans for ``exported`` (the device's own code,
    :mod:`edge.tensorrt`), cached under ``cache_dir`` by (TensorRT, compute capability, precision, ONNX digest).
    Pass the returned paths to ``package(..., engines=…)``; a device uses a plan only on an exact key match."""
    from edge.tensorrt import EngineCache

    cache = EngineCache(cache_dir)
    return [cache.path(cache.get_or_build(exported.path, exported.digest, p, dla_core if p == "fp16" else None)[0])
            for p in precisions]
