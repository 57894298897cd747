"""Inference runtimes behind one interface (``run((B, obs)) -> (B, act)``, ``name``, ``providers``) and the
choice among them: TensorRT (edge.tensorrt) where installed, ONNX Runtime CUDA, ONNX Runtime CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np


class OnnxRuntime:
    """ONNX Runtime session with one float32 input and one output, single-threaded by default."""

    name = "onnxruntime"

    def __init__(self, onnx_path: Path, providers: Sequence[str] = ("CPUExecutionProvider",), threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        available = set(ort.get_available_providers())
        chosen: List[str] = [p for p in providers if p in available] or ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=chosen)
        self.providers = self.session.get_providers()
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        # InferenceSession.run is a Python wrapper (feed-name validation, EP-failure fallback) around the
        # compiled session's run; on the CPU provider alone, where no fallback applies and act() checks the
        # input's shape itself, call the compiled run directly (~3 us less per call); else the public one.
        compiled = getattr(self.session, "_sess", None)
        if self.providers == ["CPUExecutionProvider"] and compiled is not None and hasattr(compiled, "run"):
            self._run = lambda feeds: compiled.run([self.output_name], feeds, None)
        else:
            self._run = lambda feeds: self.session.run([self.output_name], feeds)
        self.compiled_run = self.providers == ["CPUExecutionProvider"] and compiled is not None

    def run(self, obs: np.ndarray) -> np.ndarray:
        """(B, obs_dim) float32 → (B, act_dim) float32."""
        return self._run({self.input_name: obs})[0]


@dataclass(frozen=True)
class Selection:
    """The runtime chosen for a bundle and why each earlier candidate was passed over."""

    runtime: object
    skipped: Tuple[Tuple[str, str], ...]

    def describe(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in self.skipped)
        return f"{self.runtime.name} ({', '.join(self.runtime.providers)})" + (f" [skipped {why}]" if why else "")


def _tensorrt(onnx_path: Path, manifest: dict, engines_dir: Optional[Path], build: bool):
    from edge import tensorrt

    precision = manifest.get("runtime", {}).get("tensorrt_precision", "fp16")
    dla = manifest.get("runtime", {}).get("tensorrt_dla_core")
    digest = manifest["files"]["policy.onnx"]["sha256"]
    key = tensorrt.local_key(digest, precision, dla)  # raises EngineUnavailable without TensorRT or a GPU
    bundled = onnx_path.parent / "engines" / key.filename  # a prebuilt plan: exact key match only
    plan = bundled.read_bytes() if bundled.is_file() else None
    if plan is None and engines_dir is not None:
        cache = tensorrt.EngineCache(engines_dir)
        plan = cache.get_or_build(onnx_path, digest, precision, dla)[1] if build else cache.get(key)
    if plan is None:
        raise tensorrt.EngineUnavailable(f"no plan for {key.filename} (bundled or cached) and building is off")
    return tensorrt.TensorRTRuntime(plan, key)


def _onnxruntime_cuda(onnx_path: Path, manifest: dict):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError("this onnxruntime build has no CUDAExecutionProvider")
    runtime = OnnxRuntime(onnx_path, ("CUDAExecutionProvider",))
    if runtime.providers[0] != "CUDAExecutionProvider":  # ORT falls back silently: check what it really uses
        raise RuntimeError(f"CUDAExecutionProvider did not initialise (session uses {runtime.providers})")
    n_obs = runtime.session.get_inputs()[0].shape[1]
    runtime.run(np.zeros((1, n_obs), np.float32))  # a real inference, not just the compiled-in list
    return runtime


CANDIDATES = ("tensorrt", "onnxruntime-cuda", "onnxruntime-cpu")


def select_runtime(onnx_path: Path, manifest: dict, engines_dir: Optional[Path] = None,
                   build_engines: bool = False) -> Selection:
    """TensorRT → ONNX Runtime CUDA → ONNX Runtime CPU, limited to what the manifest's ``runtime.preference``
    allows (``tensorrt``, ``onnxruntime``); the first that works is used and the others' reasons are reported."""
    preference = manifest.get("runtime", {}).get("preference", ["tensorrt", "onnxruntime"])
    unknown = [p for p in preference if p not in ("tensorrt", "onnxruntime")]
    if unknown:
        raise ValueError(f"manifest runtime.preference: unknown runtime {unknown[0]!r} (known: tensorrt, onnxruntime)")
    providers = manifest.get("runtime", {}).get("onnxruntime_providers", ["CPUExecutionProvider"])
    skipped: List[Tuple[str, str]] = []
    for name in CANDIDATES:
        if name.split("-")[0] not in preference:
            continue
        if name == "onnxruntime-cuda" and "CUDAExecutionProvider" not in providers:
            skipped.append((name, "not in the manifest's onnxruntime_providers"))
            continue
        try:
            if name == "tensorrt":
                return Selection(_tensorrt(onnx_path, manifest, engines_dir, build_engines), tuple(skipped))
            if name == "onnxruntime-cuda":
                return Selection(_onnxruntime_cuda(onnx_path, manifest), tuple(skipped))
            return Selection(OnnxRuntime(onnx_path, ("CPUExecutionProvider",)), tuple(skipped))
        except Exception as e:  # each runtime fails in its own way; the reason is reported, the next one tried
            skipped.append((name, str(e)))
    raise RuntimeError("no runtime could load the policy: " + "; ".join(f"{n}: {r}" for n, r in skipped))
