"""Small real bundles for the agent's tests: a tiny ONNX graph built with onnx.helper, signed."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from edge import bundle, signing


def tiny_onnx(weight: float = 0.5) -> bytes:
    """action = clip(obs @ W, -1, 1): (B, 5) → (B, 1)."""
    w = numpy_helper.from_array(np.full((5, 1), weight, np.float32), "W")
    lo, hi = (numpy_helper.from_array(np.array(v, np.float32), n) for v, n in ((-1.0, "lo"), (1.0, "hi")))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["obs", "W"], ["y"]), helper.make_node("Clip", ["y", "lo", "hi"], ["action"])],
        "tiny", [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", 1])], [w, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def golden(weight: float = 0.5) -> bytes:
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, inputs=x, outputs=np.clip(x @ np.full((5, 1), weight, np.float32), -1, 1))
    return buf.getvalue()


def manifest(version: str = "1", target: str = "orin-jp6.1", period_s: float = 0.02) -> dict:
    return {
        "policy": {"name": "tiny", "version": version, "task": "cartpole"},
        "provenance": {"mlflow_run_id": "test"},
        "target": {"name": target},
        "control": {"period_s": period_s},
        "runtime": {"onnxruntime_providers": ["CPUExecutionProvider"]},
        "parity_tolerance": {"fp32": {"atol": 1e-5, "rtol": 1e-4}},
    }


def make_keys(tmp: Path, name: str = "k") -> tuple[Path, Path]:
    priv, pub = tmp / f"{name}.key", tmp / f"{name}.pub"
    signing.generate_keypair(priv, pub)
    return priv, pub


def make_bundle(out: Path, private_key: Path, files: dict | None = None, **manifest_args) -> str:
    key = signing.load_private(private_key)
    files = files if files is not None else {"policy.onnx": tiny_onnx(), "golden.npz": golden()}
    return bundle.write_bundle(out, files, manifest(**manifest_args), key.sign)
