"""Package: a signed, Jetson-targeted bundle, written through ``edge.bundle`` (the device's reader)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from edge import bundle, signing
from edge.targets import load_target
from stages.artifacts import BundleArtifact, Checkpoint, Dataset, EvalReport, ExportedPolicy, TwinSpec
from stages.sim.registry import load


class PackageConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    target: str = Field("orin-jp6.1", description="Jetson target profile (see `sim2edge targets`).")
    fp32_atol: float = Field(1e-4, gt=0, description="Device parity tolerance for FP32 runtimes.")
    fp16_atol: float = Field(1e-2, gt=0, description="Device parity tolerance for FP16 TensorRT engines.")


def signing_key(keys_dir: Path) -> Path:
    """The workspace's private signing key, generated on first use (or ``SIM2EDGE_SIGNING_KEY``)."""
    if os.environ.get("SIM2EDGE_SIGNING_KEY"):
        return Path(os.environ["SIM2EDGE_SIGNING_KEY"])
    private = keys_dir / "signing.key"
    if not private.exists():
        signing.generate_keypair(private, keys_dir / "signing.pub")
    return private


def manifest_for(cfg: PackageConfig, policy_name: str, version: str, exported: ExportedPolicy, report: EvalReport,
                 checkpoint: Checkpoint, twin: TwinSpec, dataset: Dataset, provenance: dict) -> dict:
    """The bundle manifest (DESIGN.md), without the file list that ``write_bundle`` adds."""
    task = load(exported.task)
    target = load_target(cfg.target)
    if exported.opset > target.max_opset:
        raise ValueError(f"policy opset {exported.opset} exceeds {target.name}'s TensorRT {target.tensorrt} maximum {target.max_opset}")
    low, high = task.model.actuator_ctrlrange.T
    return {
        "policy": {"name": policy_name, "version": version, "task": task.name},
        "provenance": {**provenance, "checkpoint_sha256": checkpoint.digest, "onnx_sha256": exported.digest,
                       "dataset_digest": dataset.digest, "dataset_version": dataset.version, "twin_digest": twin.digest},
        "target": {**target.to_dict(), "opset": exported.opset},
        "io": {
            "input": {"name": "obs", "shape": [-1, task.obs_dim], "dtype": "float32",
                      "terms": [{"name": o.name, "unit": o.unit} for o in task.observations]},
            "output": {"name": "action", "shape": [-1, task.act_dim], "dtype": "float32",
                       "terms": [{"name": a.name, "unit": a.unit} for a in task.actions],
                       "low": low.tolist(), "high": high.tolist(), "default": task.action_default.tolist(),
                       "scale": task.action_scale.tolist()},
        },
        "control": {"period_s": task.ctrl_dt, "physics_dt_s": task.model.opt.timestep, "decimation": task.decimation},
        "runtime": {"preference": ["tensorrt", "onnxruntime"], "tensorrt_precision": "fp16",
                    "onnxruntime_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]},
        "parity_tolerance": {"fp32": {"atol": cfg.fp32_atol, "rtol": 1e-4}, "fp16": {"atol": cfg.fp16_atol, "rtol": 1e-2}},
        "evaluation": {"success_rate": report.success_rate, "mean_return": report.mean_return,
                       "episodes": report.episodes, "passed": report.passed, "twin": "calibrated twin"},
    }


def package(cfg: PackageConfig, manifest: dict, exported: ExportedPolicy, keys_dir: Path, out: Path) -> BundleArtifact:
    """Write the signed bundle ``out`` (one tar) atomically."""
    key = signing.load_private(signing_key(keys_dir))
    files = {"policy.onnx": exported.path.read_bytes(), "golden.npz": exported.golden.read_bytes()}
    digest = bundle.write_bundle(out, files, manifest, key.sign)
    return BundleArtifact(path=out, digest=digest, target=cfg.target, policy=manifest["policy"]["name"],
                          version=manifest["policy"]["version"])
