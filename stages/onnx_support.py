"""Which ONNX graphs each target reads: its TensorRT parser's opset range and operators, and its onnxruntime's
IR version, checked before packaging.

The operator sets are onnx-tensorrt's ``docs/operators.md`` rows marked supported, per release
branch (8.4's list plus what 8.5, 8.6 and 10.x added). An operator not in the set is refused:
a false refusal costs a re-export here, a false acceptance a failed engine build on the device.
Only the default ONNX domain is parsed natively; other domains (``com.microsoft``, custom ops)
need a TensorRT plugin and are refused.

The onnxruntime per JetPack is the default of dusty-nv/jetson-containers
(``packages/ml/onnxruntime/config.py``): 1.16.3 on L4T 35 (JetPack 5), 1.17 on L4T 36 up to CUDA 12.2
(JetPack 6.0), 1.20+ from CUDA 12.4 (JetPack 6.1/6.2); its newest readable IR version is that of the
ONNX release it was built with (``onnx.helper.VERSION_TABLE``: ONNX 1.14/1.15 → IR 9, 1.16/1.17 → IR 10).
A model with a newer IR fails to load there ("Unsupported model IR version").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from edge.targets import TargetProfile

_TRT_8_5 = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike Ceil Celu
Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout
Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gemm GlobalAveragePool
GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GRU HardSigmoid HardSwish Identity If ImageScaler
InstanceNormalization IsNaN LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul
Max MaxPool Mean Min Mul Neg NonMaxSuppression Not Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN Round ScaledTanh Scan Scatter
ScatterElements ScatterND Selu Shape Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split
Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Unsqueeze Upsample Where Xor
""".split())
_TRT_8_6 = _TRT_8_5 | {"LayerNormalization", "GridSample", "IsInf", "Mod", "NonZero", "OneHot", "RoiAlign", "Shrink"}
_TRT_10 = _TRT_8_6 | {"BlackmanWindow", "HammingWindow", "HannWindow", "GroupNormalization", "Gelu", "Mish", "Hardmax"}


@dataclass(frozen=True)
class ParserSupport:
    """What one TensorRT version's ONNX parser reads."""

    tensorrt: str
    min_opset: int
    max_opset: int
    ops: frozenset


@dataclass(frozen=True)
class OnnxRuntimeSupport:
    """The oldest onnxruntime a JetPack release's images carry and the newest IR version it loads."""

    onnxruntime: str
    max_ir_version: int


# keyed by JetPack major.minor
ONNXRUNTIMES = {
    "5.1": OnnxRuntimeSupport("1.16.3", 9),
    "6.0": OnnxRuntimeSupport("1.17", 9),
    "6.1": OnnxRuntimeSupport("1.20", 10),
    "6.2": OnnxRuntimeSupport("1.20", 10),
    "7.0": OnnxRuntimeSupport("1.22", 10),  # unverified: 1.22 is built with ONNX 1.17 (IR 10) or later
}


def onnxruntime_for(target: TargetProfile) -> OnnxRuntimeSupport:
    """The onnxruntime row of ``target``'s JetPack."""
    try:
        return ONNXRUNTIMES[target.jetpack]
    except KeyError:
        raise UnsupportedOnnx(f"target {target.name}: no onnxruntime row for JetPack {target.jetpack} "
                              f"(known: {', '.join(ONNXRUNTIMES)})") from None


# keyed by TensorRT major.minor; opset ranges from JETSON.md ("ONNX opset per TensorRT parser")
PARSERS = {p.tensorrt: p for p in (
    ParserSupport("8.5", 1, 17, _TRT_8_5),
    ParserSupport("8.6", 1, 17, _TRT_8_6),
    ParserSupport("10.3", 9, 20, _TRT_10),
    ParserSupport("10.13", 9, 20, _TRT_10),  # JETSON.md: 9 – 24 unverified; 20 until confirmed on a Thor
)}


class UnsupportedOnnx(ValueError):
    """The graph uses an opset or operator the target's TensorRT cannot parse."""


def parser_for(target: TargetProfile) -> ParserSupport:
    """The parser support row of ``target``'s TensorRT version (major.minor)."""
    key = ".".join(target.tensorrt.split(".")[:2])
    try:
        return PARSERS[key]
    except KeyError:
        raise UnsupportedOnnx(f"target {target.name}: no ONNX support table for TensorRT {target.tensorrt} "
                              f"(known: {', '.join(PARSERS)})") from None


def _nodes(graph: onnx.GraphProto):
    """Every node, including those in If/Loop/Scan bodies."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _nodes(sub)


def check_onnx_support(onnx_path: Path, target: TargetProfile) -> None:
    """Raise :class:`UnsupportedOnnx` naming the file, the target and the first offending opset or operator."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    parser = parser_for(target)
    where = f"{onnx_path.name} for target {target.name} (TensorRT {target.tensorrt})"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise UnsupportedOnnx(f"{where}: the model imports no default-domain opset")
    if not parser.min_opset <= opset <= parser.max_opset:
        raise UnsupportedOnnx(f"{where}: opset {opset} is outside TensorRT {parser.tensorrt}'s "
                              f"{parser.min_opset}–{parser.max_opset}; re-export at opset ≤ {parser.max_opset}")
    ort = onnxruntime_for(target)
    if model.ir_version > ort.max_ir_version:
        raise UnsupportedOnnx(f"{onnx_path.name} for target {target.name}: IR version {model.ir_version} is newer than "
                              f"onnxruntime {ort.onnxruntime} (JetPack {target.jetpack}) reads (≤ {ort.max_ir_version}); "
                              f"re-export with the IR version lowered")
    for node in _nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedOnnx(f"{where}: operator {node.domain}::{node.op_type} (node {node.name!r}) is not in "
                                  f"the default ONNX domain; TensorRT {parser.tensorrt} would need a plugin")
        if node.op_type not in parser.ops:
            raise UnsupportedOnnx(f"{where}: operator {node.op_type} (node {node.name!r}) is not supported by "
                                  f"TensorRT {parser.tensorrt}'s ONNX parser")
