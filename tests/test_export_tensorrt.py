"""TensorRT: the engine cache key, the runtime choice TensorRT → ONNX Runtime CUDA → CPU with its reasons
(both for real on this host), and engine build + Polygraphy comparison where TensorRT is installed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from edge import bundle, signing
from edge.runtime import select_runtime
from edge.smoke import smoke_test
from edge.tensorrt import EngineCache, EngineKey, EngineUnavailable, tensorrt_module
from tests.bundles import linear_onnx, make_bundle, make_keys

NO_TRT = "TensorRT is not installable on this machine (PyPI wheels are stubs that fetch from an unreachable index)"
try:
    import tensorrt  # noqa: F401

    HAVE_TRT = True
except ImportError:
    HAVE_TRT = False
needs_trt = pytest.mark.skipif(not HAVE_TRT, reason=NO_TRT)
DIGEST = hashlib.sha256(b"policy").hexdigest()


def test_engine_key_names_every_part_and_refuses_bad_values():
    key = EngineKey("10.3.0", "8.7", "fp16", DIGEST, dla_core=1)
    assert key.filename == f"trt10.3.0-sm87-fp16-dla1-{DIGEST[:16]}.plan"
    variants = {EngineKey(*args).filename for args in [("10.3.0", "8.7", "fp16", DIGEST), ("10.3.0", "8.7", "fp32", DIGEST),
                                                       ("8.6.2", "8.7", "fp16", DIGEST), ("10.3.0", "7.2", "fp16", DIGEST),
                                                       ("10.3.0", "8.7", "fp16", hashlib.sha256(b"other").hexdigest())]}
    assert len(variants) == 5, "each part of the key changes the plan's name"
    with pytest.raises(ValueError, match="precision 'int4'"):
        EngineKey("10.3.0", "8.7", "int4", DIGEST)
    with pytest.raises(ValueError, match="DLA runs FP16/INT8 only"):
        EngineKey("10.3.0", "8.7", "fp32", DIGEST, dla_core=0)
    with pytest.raises(ValueError, match="not a sha256"):
        EngineKey("10.3.0", "8.7", "fp16", "abc")


def test_engine_cache_round_trip_is_exact_match_only(tmp_path):
    cache = EngineCache(tmp_path / "engines")
    key = EngineKey("10.3.0", "8.7", "fp16", DIGEST)
    assert cache.get(key) is None
    cache.put(key, b"plan-bytes")
    assert cache.get(key) == b"plan-bytes"
    assert cache.get(EngineKey("10.3.1", "8.7", "fp16", DIGEST)) is None, "another TensorRT version never matches"
    assert [p.name for p in (tmp_path / "engines").iterdir()] == [key.filename], "no temporary file left"


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_without_tensorrt_the_choice_falls_back_and_says_why(tmp_path):
    with pytest.raises(EngineUnavailable, match="TensorRT is not installed"):
        tensorrt_module()
    priv, pub = make_keys(tmp_path)
    make_bundle(tmp_path / "b.tar", priv)
    (tmp_path / "x").mkdir()
    bundle.extract(tmp_path / "b.tar", tmp_path / "x", 1 << 24)
    manifest = bundle.verify_dir(tmp_path / "x", signing.load_trusted([pub]))
    both = dict(manifest, runtime={"preference": ["tensorrt", "onnxruntime"],
                                   "onnxruntime_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    sel = select_runtime(tmp_path / "x" / "policy.onnx", both)
    assert sel.runtime.name == "onnxruntime" and sel.runtime.providers == ["CPUExecutionProvider"]
    assert [n for n, _ in sel.skipped] == ["tensorrt", "onnxruntime-cuda"]
    assert "TensorRT is not installed" in sel.skipped[0][1] and "CUDAExecutionProvider" in sel.skipped[1][1]
    assert sel.describe().startswith("onnxruntime (CPUExecutionProvider) [skipped tensorrt: TensorRT is not installed")
    ort_only = dict(manifest, runtime={"preference": ["onnxruntime"], "onnxruntime_providers": ["CPUExecutionProvider"]})
    sel = select_runtime(tmp_path / "x" / "policy.onnx", ort_only)
    assert sel.skipped == (("onnxruntime-cuda", "not in the manifest's onnxruntime_providers"),)
    trt_only = dict(manifest, runtime={"preference": ["tensorrt"]})
    with pytest.raises(RuntimeError, match="no runtime could load the policy: tensorrt: TensorRT is not installed"):
        select_runtime(tmp_path / "x" / "policy.onnx", trt_only)
    with pytest.raises(ValueError, match="unknown runtime 'tflite'"):
        select_runtime(tmp_path / "x" / "policy.onnx", dict(manifest, runtime={"preference": ["tflite"]}))
    assert "skipped tensorrt" in smoke_test(tmp_path / "x", both).runtime


@needs_trt
@pytest.mark.tensorrt
@pytest.mark.parametrize("precision,atol", [("fp32", 1e-5), ("fp16", 1e-2)])
def test_engine_builds_caches_and_matches_onnxruntime(tmp_path, precision, atol):
    from edge.runtime import OnnxRuntime
    from edge.tensorrt import TensorRTRuntime

    onnx_path = tmp_path / "policy.onnx"
    onnx_path.write_bytes(linear_onnx(np.random.default_rng(0).normal(size=(5, 2)).astype(np.float32)))
    digest = bundle.sha256_path(onnx_path)
    cache = EngineCache(tmp_path / "engines")
    key, plan, built = cache.get_or_build(onnx_path, digest, precision)
    assert built and cache.get_or_build(onnx_path, digest, precision)[2] is False, "second call hits the cache"
    x = np.random.default_rng(1).normal(size=(16, 5)).astype(np.float32)
    np.testing.assert_allclose(TensorRTRuntime(plan, key).run(x), OnnxRuntime(onnx_path).run(x), atol=atol)


@needs_trt
@pytest.mark.tensorrt
def test_polygraphy_compares_engine_and_onnxruntime(tmp_path):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.comparator import Comparator, CompareFunc

    onnx_path = tmp_path / "policy.onnx"
    onnx_path.write_bytes(linear_onnx(np.full((5, 1), 0.3, np.float32)))
    key, plan, _ = EngineCache(tmp_path / "e").get_or_build(onnx_path, bundle.sha256_path(onnx_path), "fp16")
    results = Comparator.run([TrtRunner(EngineFromBytes(plan)), OnnxrtRunner(SessionFromOnnx(str(onnx_path)))])
    assert bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=1e-2, rtol=1e-2)))
