"""Package: a signed, Jetson-targeted bundle, written through ``edge.bundle`` (the device's reader).

Before anything is written the ONNX graph is checked against the target's TensorRT parser
(opset and every operator) and onnxruntime (IR version), :mod:`stages.onnx_support`; the bundle is
deterministic (same inputs, same bytes) and signed with the workspace key or ``SIM2EDGE_SIGNING_KEY``.

The bundle's ``policy.onnx`` is the exported graph with the manifest's contract, policy name and version
written into its metadata (:func:`stages.export.annotate`): the version exists only once registration
reserves it, after export. Its sha256 is therefore the manifest's ``files`` entry, while
``provenance.onnx_sha256`` names the export stage's file; prebuilt TensorRT plans (which metadata does
not change) are renamed to the bundled file's digest.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from pydantic import BaseModel, ConfigDict, Field

from edge import bundle, signing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from edge.targets import load_target
from stages.artifacts import BundleArtifact, Checkpoint, Dataset, EvalReport, ExportedPolicy, TwinSpec
from stages.export import annotate
from stages.io_spec import IOSpec
from stages.onnx_support import check_onnx_support
from stages.sim.registry import load


class PackageConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    target: str = Field("orin-jp6.1", description="Jetson target profile (see `sim2edge targets`).")
    fp32_atol: float = Field(1e-4, gt=0, description="Device parity tolerance for FP32 runtimes.")
    fp16_atol: float = Field(1e-2, gt=0, description="Device parity tolerance for FP16 TensorRT engines.")


def workspace_key(keys_dir: Path) -> Ed25519PrivateKey:
    """``SIM2EDGE_SIGNING_KEY`` when set, else the workspace's ``signing.key`` (generated on first use)."""
    private = keys_dir / "signing.key"
    if not os.environ.get(signing.ENV_KEY) and not private.exists():
        signing.generate_keypair(private, keys_dir / "signing.pub")
    return signing.signing_key(private)


def manifest_for(cfg: PackageConfig, policy_name: str, version: str, exported: ExportedPolicy, report: EvalReport,
                 checkpoint: Checkpoint, twin: TwinSpec, dataset: Dataset, provenance: dict) -> dict:
    """The manifest of a policy trained here (DESIGN.md), without the file list that ``write_bundle`` adds."""
    provenance = {**provenance, "checkpoint_sha256": checkpoint.digest, "dataset_digest": dataset.digest,
                  "dataset_version": dataset.version, "twin_digest": twin.digest}
    evaluation = {"success_rate": report.success_rate, "mean_return": report.mean_return,
                  "episodes": report.episodes, "passed": report.passed, "twin": "calibrated twin"}
    return build_manifest(cfg, policy_name, version, exported, IOSpec.from_task(load(exported.task)), provenance,
                          evaluation)


def build_manifest(cfg: PackageConfig, policy_name: str, version: str, exported: ExportedPolicy, spec: IOSpec,
                   provenance: dict, evaluation: dict | None) -> dict:
    """The manifest for any exported policy and its I/O spec; names and batch come from the ONNX graph."""
    target = load_target(cfg.target)
    graph = onnx.load(str(exported.path), load_external_data=False).graph
    if len(graph.input) != 1 or len(graph.output) != 1:
        raise ValueError(f"{exported.path}: the device runtime needs one input and one output, "
                         f"the graph has {len(graph.input)} and {len(graph.output)}")
    dim0 = graph.input[0].type.tensor_type.shape.dim[0]
    batch = dim0.dim_value if dim0.HasField("dim_value") else -1
    golden = np.load(exported.golden)["outputs"]
    return {
        "policy": {"name": policy_name, "version": version, "task": spec.task},
        "provenance": {**provenance, "onnx_sha256": exported.digest},
        "target": {**target.to_dict(), "opset": exported.opset},
        "io": spec.manifest_io(graph.input[0].name, graph.output[0].name, batch),
        "control": spec.manifest_control(),
        "runtime": {"preference": ["tensorrt", "onnxruntime"], "tensorrt_precision": "fp16",
                    "onnxruntime_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]},
        "parity_tolerance": {"fp32": {"atol": cfg.fp32_atol, "rtol": 1e-4}, "fp16": {"atol": cfg.fp16_atol, "rtol": 1e-2}},
        "golden": {"samples": len(golden), "unsaturated_fraction": float(spec.unsaturated(golden).mean())},
        "evaluation": evaluation,
    }


def released_onnx(exported: ExportedPolicy, manifest: dict) -> bytes:
    """The bundle's ``policy.onnx``: the exported graph with the manifest's contract, name and version annotated."""
    model = onnx.load(str(exported.path), load_external_data=False)
    annotate(model, manifest["io"], manifest["control"], manifest["policy"])
    return model.SerializeToString()


def rekeyed(plan: Path, exported: ExportedPolicy, onnx_sha256: str) -> str:
    """A prebuilt plan's bundle name for the released ONNX (the plan must have been built from ``exported``)."""
    name, n = re.subn(rf"-{exported.digest[:16]}\.plan$", f"-{onnx_sha256[:16]}.plan", plan.name)
    if not n:
        raise ValueError(f"engine {plan.name}: not built from {exported.path.name} (sha256 {exported.digest[:16]}…)")
    return name


def polygraphy_files(exported: ExportedPolicy, rows: int = 16) -> dict[str, bytes]:
    """The golden inputs and reference outputs in Polygraphy's JSON formats, one row per iteration, so a device
    repeats the build host's comparison: ``polygraphy run policy.onnx --trt --load-inputs polygraphy_inputs.json
    --load-outputs polygraphy_outputs.json`` (``--fp16 --atol 1e-2`` for FP16)."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import to_json

    graph = onnx.load(str(exported.path), load_external_data=False).graph
    golden = np.load(exported.golden)
    inputs = [{graph.input[0].name: golden["inputs"][i:i + 1]} for i in range(min(rows, len(golden["inputs"])))]
    results = RunResults()
    results.append(("onnxrt-runner-build-host", [IterationResult({graph.output[0].name: golden["outputs"][i:i + 1]},
                                                                 runner_name="onnxrt-runner-build-host")
                                                 for i in range(len(inputs))]))
    return {"polygraphy_inputs.json": to_json(inputs).encode(), "polygraphy_outputs.json": to_json(results).encode()}


def package(cfg: PackageConfig, manifest: dict, exported: ExportedPolicy, keys_dir: Path, out: Path,
            engines: Sequence[Path] = ()) -> BundleArtifact:
    """Check the graph against the target's TensorRT, then write the signed bundle ``out`` (one tar) atomically.
    ``engines``: prebuilt plans of ``exported`` (``stages.export.build_engines``), stored as ``engines/<key>.plan``
    under the bundled ``policy.onnx``'s digest, the one the device looks plans up by."""
    check_onnx_support(exported.path, load_target(cfg.target))
    key = workspace_key(keys_dir)
    policy = released_onnx(exported, manifest)
    onnx_sha256 = hashlib.sha256(policy).hexdigest()
    files = {"policy.onnx": policy, "golden.npz": exported.golden.read_bytes(), **polygraphy_files(exported),
             **{f"engines/{rekeyed(p, exported, onnx_sha256)}": p.read_bytes() for p in engines}}
    digest = bundle.write_bundle(out, files, manifest, key.sign)
    return BundleArtifact(path=out, digest=digest, target=cfg.target, policy=manifest["policy"]["name"],
                          version=manifest["policy"]["version"])
