"""The ONNX check before packaging: every operator and the opset against the target's TensorRT parser."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge.targets import PROFILES, load_target
from stages.onnx_support import PARSERS, UnsupportedOnnx, check_onnx_support, parser_for


def graph_file(tmp_path, nodes, opset=17, name="g.onnx", domains=()):
    """(B, 4) → (B, 4) through ``nodes`` (inputs ``obs``, output ``action``), saved under ``tmp_path``."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] +
                              [helper.make_opsetid(d, 1) for d in domains])
    model.ir_version = 8
    path = tmp_path / name
    path.write_bytes(model.SerializeToString())
    return path


def test_every_target_has_a_parser_row_that_agrees_with_its_max_opset():
    for target in PROFILES.values():
        assert parser_for(target).max_opset == target.max_opset, target.name
    assert set(PARSERS) == {"8.5", "8.6", "10.3", "10.13"}


@pytest.mark.parametrize("target", sorted(PROFILES))
def test_a_policy_graph_passes_on_every_target(tmp_path, target):
    ok = graph_file(tmp_path, [helper.make_node("MatMul", ["obs", "W"], ["h"]), helper.make_node("Elu", ["h"], ["e"]),
                               helper.make_node("Tanh", ["e"], ["action"])])
    check_onnx_support(ok, load_target(target))


def test_unsupported_operator_is_named_with_the_target(tmp_path):
    # Det (matrix determinant) has no TensorRT importer in any release; here it sits in an If branch
    det = helper.make_graph([helper.make_node("Det", ["obs"], ["d"], name="det0"),
                             helper.make_node("Identity", ["obs"], ["b"])], "then", [],
                            [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    same = helper.make_graph([helper.make_node("Identity", ["obs"], ["c"])], "else", [],
                             [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    cond = numpy_helper.from_array(np.array(True), "cond")
    path = graph_file(tmp_path, [helper.make_node("Constant", [], ["cond"], value=cond),
                                 helper.make_node("If", ["cond"], ["action"], then_branch=det, else_branch=same)])
    with pytest.raises(UnsupportedOnnx, match=r"g.onnx for target orin-jp6.1 \(TensorRT 10.3\): operator Det "
                                              r"\(node 'det0'\) is not supported by TensorRT 10.3's ONNX parser"):
        check_onnx_support(path, load_target("orin-jp6.1"))


def test_operator_supported_only_on_newer_tensorrt(tmp_path):
    # LayerNormalization (opset 17) parses from TensorRT 8.6 on, not on JetPack 5's 8.5
    scale, bias = (numpy_helper.from_array(np.full(4, v, np.float32), n) for v, n in ((1.0, "s"), (0.0, "b")))
    path = graph_file(tmp_path, [helper.make_node("Constant", [], ["scale"], value=scale),
                                 helper.make_node("Constant", [], ["bias"], value=bias),
                                 helper.make_node("LayerNormalization", ["obs", "scale", "bias"], ["action"], name="ln")])
    check_onnx_support(path, load_target("orin-jp6.0"))
    with pytest.raises(UnsupportedOnnx, match="target xavier-jp5.1 .*operator LayerNormalization \\(node 'ln'\\)"):
        check_onnx_support(path, load_target("xavier-jp5.1"))


def test_custom_domain_operator_is_refused(tmp_path):
    path = graph_file(tmp_path, [helper.make_node("FusedMatMul", ["obs", "W"], ["action"], domain="com.microsoft")],
                      domains=("com.microsoft",))
    with pytest.raises(UnsupportedOnnx, match="operator com.microsoft::FusedMatMul .*would need a plugin"):
        check_onnx_support(path, load_target("thor-jp7.0"))


@pytest.mark.parametrize("target,opset,ok", [("orin-jp5.1", 17, True), ("orin-jp5.1", 18, False),
                                             ("orin-jp6.0", 18, False), ("orin-jp6.1", 20, True),
                                             ("orin-jp6.2", 21, False), ("thor-jp7.0", 8, False)])
def test_opset_range_per_target(tmp_path, target, opset, ok):
    path = graph_file(tmp_path, [helper.make_node("MatMul", ["obs", "W"], ["action"])], opset=opset)
    if ok:
        check_onnx_support(path, load_target(target))
    else:
        with pytest.raises(UnsupportedOnnx, match=f"for target {target} .*: opset {opset} is outside TensorRT"):
            check_onnx_support(path, load_target(target))
