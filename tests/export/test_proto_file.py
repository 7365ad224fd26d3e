"""vit_export.proto_file.save_proto writes what onnx.save writes, field by field: onnx's own loader reads back an
equal message, its C++ checker passes the file, and onnxruntime (a second reader) computes the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from vit_export.proto_file import save_proto


def _model(big: int = 300) -> onnx.ModelProto:
    """y = relu(x @ W1 + b) @ W2, with initializers of several sizes (one over 128 KB: a multi-byte length
    varint), doc strings, metadata and a value_info."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, big)).astype(np.float32), "w1")
    b = numpy_helper.from_array(rng.standard_normal(big).astype(np.float32), "b")
    w2 = numpy_helper.from_array(rng.standard_normal((big, 3)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h2"]), helper.make_node("MatMul", ["h2", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [w1, b, w2],
                              doc_string="a test graph",
                              value_info=[helper.make_tensor_value_info("h2", TensorProto.FLOAT, ["n", big])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="vit-export")
    helper.set_model_props(model, {"vit_export": '{"k": 1}'})
    return model


@pytest.mark.parametrize("big", [1, 300, 5000])
def test_onnx_reads_back_an_equal_model_and_onnxruntime_agrees(tmp_path, big):
    model = _model(big)
    ours, theirs = tmp_path / "ours.onnx", tmp_path / "theirs.onnx"
    save_proto(model, ours)
    onnx.save(model, theirs)
    assert onnx.load(str(ours)) == model == onnx.load(str(theirs))
    assert len(model.graph.initializer) == 3  # the proto given is left whole
    onnx.checker.check_model(str(ours), full_check=True)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    run = {p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
           for p in (ours, theirs)}
    np.testing.assert_array_equal(run[ours], run[theirs])


def test_a_model_without_initializers(tmp_path):
    model = _model()
    del model.graph.initializer[:]
    save_proto(model, tmp_path / "m.onnx")
    assert onnx.load(str(tmp_path / "m.onnx")) == model
