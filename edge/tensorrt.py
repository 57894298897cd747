"""TensorRT engines: build from ONNX (FP32, FP16, optional DLA core with GPU fallback), cache, run.

``tensorrt`` (and ``cuda-python`` for device memory) are imported only when used, so this module
imports on any host. Engines are not portable: the cache key is (TensorRT version, GPU compute
capability, precision, DLA core, ONNX sha256) and a plan is only used on an exact match.
Written against the TensorRT 10 Python API (``create_network(0)``: explicit batch is the only mode;
``set_memory_pool_limit``; ``build_serialized_network``; ``execute_async_v3`` with tensor addresses).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

PRECISIONS = ("fp32", "fp16")


class EngineUnavailable(RuntimeError):
    """TensorRT (or a GPU, or a matching plan) is not there; the message says which."""


@dataclass(frozen=True)
class EngineKey:
    """What a TensorRT plan is valid for; only an exact match is used."""

    tensorrt: str
    compute_capability: str  # e.g. "8.7" (Orin), "7.2" (Xavier)
    precision: str
    onnx_sha256: str
    dla_core: Optional[int] = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.dla_core is not None and self.precision != "fp16":
            raise ValueError("DLA runs FP16/INT8 only: use precision fp16 with a DLA core")
        if not re.match(r"^[0-9a-f]{64}$", self.onnx_sha256):
            raise ValueError(f"onnx_sha256 {self.onnx_sha256!r} is not a sha256 hex digest")

    @property
    def filename(self) -> str:
        """``trt<version>-sm<cc>-<precision>[-dla<N>]-<sha256[:16]>.plan`` (also the bundle's engines/ name)."""
        dla = f"-dla{self.dla_core}" if self.dla_core is not None else ""
        return (f"trt{self.tensorrt}-sm{self.compute_capability.replace('.', '')}-{self.precision}{dla}-"
                f"{self.onnx_sha256[:16]}.plan")


def tensorrt_module():
    """``import tensorrt``, or EngineUnavailable saying why."""
    try:
        import tensorrt  # noqa: F401  (optional: GPU build hosts and Jetsons only)
    except ImportError as e:
        raise EngineUnavailable(f"TensorRT is not installed ({e})") from None
    return tensorrt


def _cudart():
    try:
        from cuda import cudart  # cuda-python
    except ImportError as e:
        raise EngineUnavailable(f"cuda-python is not installed ({e})") from None
    return cudart


def _check(result):
    """cuda-python calls return (err, *values): raise on err, return the values."""
    err, rest = result[0], result[1:]
    if int(err) != 0:
        raise EngineUnavailable(f"CUDA error {err}")
    return rest[0] if len(rest) == 1 else rest


def compute_capability(device: int = 0) -> str:
    """This GPU's compute capability as ``major.minor``."""
    cudart = _cudart()
    props = _check(cudart.cudaGetDeviceProperties(device))
    return f"{props.major}.{props.minor}"


def local_key(onnx_sha256: str, precision: str, dla_core: Optional[int] = None) -> EngineKey:
    """The key an engine built on this machine would have."""
    return EngineKey(tensorrt_module().__version__, compute_capability(), precision, onnx_sha256, dla_core)


def build_engine(onnx_path: Path, precision: str = "fp16", dla_core: Optional[int] = None,
                 workspace_bytes: int = 1 << 28, max_batch: int = 64, batch_name: str = "batch") -> bytes:
    """Parse ``onnx_path`` and build a serialized engine; parser errors name the node and the reason."""
    trt = tensorrt_module()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch always, no flag
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineUnavailable(f"TensorRT {trt.__version__} cannot parse {Path(onnx_path).name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    if dla_core is not None:
        if builder.num_DLA_cores <= dla_core:
            raise EngineUnavailable(f"DLA core {dla_core} requested, this device has {builder.num_DLA_cores}")
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = dla_core
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)  # layers DLA cannot run move to the GPU
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):  # dynamic batch: 1 … max_batch, tuned for 1 (one observation per step)
        tensor = network.get_input(i)
        rest = tuple(tensor.shape)[1:]
        if tensor.shape[0] == -1:
            profile.set_shape(tensor.name, (1,) + rest, (1,) + rest, (max_batch,) + rest)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineUnavailable(f"TensorRT {trt.__version__} failed to build {Path(onnx_path).name} ({precision})")
    return bytes(plan)


class EngineCache:
    """Plans on disk under ``root`` named by :class:`EngineKey`; written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: EngineKey) -> Path:
        return self.root / key.filename

    def get(self, key: EngineKey) -> Optional[bytes]:
        p = self.path(key)
        return p.read_bytes() if p.is_file() else None

    def put(self, key: EngineKey, plan: bytes) -> Path:
        from edge.store import no_link

        no_link(self.root).mkdir(parents=True, exist_ok=True)  # the store's engines/: a link there is refused
        fd, tmp = tempfile.mkstemp(prefix=f".{key.filename}.", dir=str(self.root))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(plan)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, str(self.path(key)))
        except BaseException:
            os.unlink(tmp)
            raise
        return self.path(key)

    def get_or_build(self, onnx_path: Path, onnx_sha256: str, precision: str,
                     dla_core: Optional[int] = None) -> Tuple[EngineKey, bytes, bool]:
        """(key, plan, built_now): the cached plan for this machine's key, else a new build stored under it."""
        key = local_key(onnx_sha256, precision, dla_core)
        plan = self.get(key)
        if plan is not None:
            return key, plan, False
        plan = build_engine(onnx_path, precision, dla_core)
        self.put(key, plan)
        return key, plan, True


class TensorRTRuntime:
    """A deserialized engine behind the runtime interface: ``run((B, obs) float32) -> (B, act) float32``."""

    name = "tensorrt"

    def __init__(self, plan: bytes, key: EngineKey) -> None:
        trt, self._cudart = tensorrt_module(), _cudart()
        self.key = key
        self.providers = [f"TensorRT {key.tensorrt} {key.precision}" + (f" DLA{key.dla_core}" if key.dla_core is not None else "")]
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineUnavailable(f"plan {key.filename} does not deserialize on this TensorRT/GPU")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(inputs) != 1 or len(outputs) != 1:
            raise EngineUnavailable(f"engine has {len(inputs)} inputs and {len(outputs)} outputs; the runtime needs 1 and 1")
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.stream = _check(self._cudart.cudaStreamCreate())
        self._buffers = {}  # batch -> (d_in, d_out, out shape)

    def _device_buffers(self, batch: int, n_obs: int):
        if batch not in self._buffers:
            self.context.set_input_shape(self.input_name, (batch, n_obs))
            out_shape = tuple(self.context.get_tensor_shape(self.output_name))
            d_in = _check(self._cudart.cudaMalloc(batch * n_obs * 4))
            d_out = _check(self._cudart.cudaMalloc(int(np.prod(out_shape)) * 4))
            self._buffers[batch] = (d_in, d_out, out_shape)
        return self._buffers[batch]

    def run(self, obs: np.ndarray) -> np.ndarray:
        """(B, obs_dim) float32 → (B, act_dim) float32, synchronously."""
        cudart = self._cudart
        x = np.ascontiguousarray(obs, dtype=np.float32)
        d_in, d_out, out_shape = self._device_buffers(x.shape[0], x.shape[1])
        self.context.set_input_shape(self.input_name, x.shape)
        out = np.empty(out_shape, np.float32)
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(cudart.cudaMemcpyAsync(d_in, x.ctypes.data, x.nbytes, h2d, self.stream))
        self.context.set_tensor_address(self.input_name, int(d_in))
        self.context.set_tensor_address(self.output_name, int(d_out))
        if not self.context.execute_async_v3(self.stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        _check(cudart.cudaMemcpyAsync(out.ctypes.data, d_out, out.nbytes, d2h, self.stream))
        _check(cudart.cudaStreamSynchronize(self.stream))
        return out

    def close(self) -> None:
        for d_in, d_out, _ in self._buffers.values():
            self._cudart.cudaFree(d_in)
            self._cudart.cudaFree(d_out)
        self._buffers.clear()
        self._cudart.cudaStreamDestroy(self.stream)
