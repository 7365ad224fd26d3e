"""Export once, any resolution, for the RoPE families (timm's `Eva`: DINOv3 with and without SwiGLU, PE-Core,
EVA-02, RoPE-ViT axial and mixed; tests/rope_models.py). One `--res dynamic` graph per family computes its rotary
tables from the input's shape with plain arithmetic (`vit_export.graph_ops`: no If / Loop / Scan, every Range's
bounds from a Shape), and onnxruntime and OpenVINO give timm's own logits and embedding (timm.create_model with
dynamic_img_size=True, random weights) within 1e-4 at two sizes the export never saw, one non-square. The explain
graph's rollout equals the eager model's; token merging with RoPE is refused in one line, exit 2."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.rope_models import ROPE_FAMILIES, ours_rope, timm_rope

pytest.importorskip("onnxscript")
pytest.importorskip("timm")

TOL = 1e-4
UNSEEN = ((9, 9), (12, 7))  # patch grids; every export below is traced at the native 4 x 4


def _x(h: int, w: int) -> torch.Tensor:
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h * 1000 + w))


@pytest.mark.parametrize("key", list(ROPE_FAMILIES))
def test_one_graph_runs_at_any_size_in_onnxruntime_and_openvino(tmp_path, key):
    import onnxruntime as ort
    from vit_export.graph_ops import graph_ops
    from vit_export.onnx_export import export_graph

    ref = timm_rope(key)
    model = ours_rope(key, ref)
    graph = export_graph(model, tmp_path / f"{key}.onnx", res="dynamic", embedding=True, simplify=False)
    ops = graph_ops(onnx.load(str(graph.path)))
    print(f"{key}: {ops.summary()}")
    assert ops.plain and ops.ops.get("Range", 0) >= 2, (ops.control_flow, ops.data_ranges)
    assert graph.info.resolution == "dynamic"
    sessions = {"onnxruntime": ort.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])}
    pytest.importorskip("openvino", reason="openvino is not installed: no second runtime")
    from vit_export.parity import OpenVINOSession

    sessions["openvino"] = OpenVINOSession(graph.path)
    p = model.cfg.patch_size
    for gh, gw in UNSEEN:
        x = _x(gh * p, gw * p)
        with torch.no_grad():
            want = ref(x).numpy()
            want_emb = ref.forward_head(ref.forward_features(x), pre_logits=True).numpy()
        for name, sess in sessions.items():
            logits, emb = sess.run(None, {"pixel_values": x.numpy()})
            errs = float(np.abs(logits - want).max()), float(np.abs(emb - want_emb).max())
            print(f"{key} {gh * p}x{gw * p} {name}: |d logits| {errs[0]:.1e}, |d embedding| {errs[1]:.1e} "
                  f"(max |logit| {np.abs(want).max():.2f})")
            assert logits.shape == want.shape and emb.shape == want_emb.shape and max(errs) <= TOL


def test_a_range_bounded_by_tensor_values_is_not_plain():
    """The check can fail: a Range whose limit is a reduction of the input's values, and an If."""
    from onnx import TensorProto, helper
    from vit_export.graph_ops import graph_ops

    def model(nodes):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        consts = [helper.make_node("Constant", [], [n], value=helper.make_tensor(n, TensorProto.FLOAT, [], [v]))
                  for n, v in (("zero", 0.0), ("one", 1.0))]
        return helper.make_model(helper.make_graph(consts + nodes, "g", [x], [y]))

    from_values = model([helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
                         helper.make_node("Range", ["zero", "m", "one"], ["y"], name="r")])
    from_shape = model([helper.make_node("Shape", ["x"], ["s"]),
                        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
                        helper.make_node("ReduceMax", ["sf"], ["m"], keepdims=0),
                        helper.make_node("Range", ["zero", "m", "one"], ["y"], name="r")])
    assert graph_ops(from_values).data_ranges == ("r",) and not graph_ops(from_values).plain
    assert graph_ops(from_shape).plain and graph_ops(from_shape).ops["Range"] == 1
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with_if = model([helper.make_node("ReduceMax", ["x"], ["c"], keepdims=0),
                     helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch, name="i")])
    ops = graph_ops(with_if)
    assert ops.control_flow == ("If i",) and ops.ops["Identity"] == 2 and not ops.plain


@pytest.mark.parametrize("key", ["dinov3", "rope_mixed"])
def test_explain_graph_rollout_equals_the_eager_model(tmp_path, key):
    """Rollout with RoPE in the graph (probabilities after rotation; DINOv3's registers cut from the map; mixed:
    per-block tables) equals `vit_serve.explain.rollout` of the eager model's attentions, logits timm's."""
    import onnxruntime as ort
    from vit_export.graph_ops import graph_ops
    from vit_export.onnx_export import export_graph

    from vit_serve.explain import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, rollout

    ref = timm_rope(key)
    model = ours_rope(key, ref)
    graph = export_graph(model, tmp_path / "e.onnx", res="dynamic", explain=True, simplify=False)
    assert graph_ops(onnx.load(str(graph.path))).plain
    sess = ort.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
    p = model.cfg.patch_size
    for gh, gw in UNSEEN:
        x = _x(gh * p, gw * p)
        with torch.no_grad():
            _, attentions = model(x, return_attention=True)
            want = rollout(attentions, (gh, gw), model.num_prefix_tokens, model.cfg.pool, DEFAULT_HEAD_FUSION,
                           DEFAULT_DISCARD_RATIO).map.numpy()
            want_logits = ref(x).numpy()
        logits, heat = sess.run(None, {"pixel_values": x.numpy()})
        errs = float(np.abs(logits - want_logits).max()), float(np.abs(heat - want).max())
        print(f"{key} explain {gh * p}x{gw * p}: |d logits| {errs[0]:.1e}, |d rollout| {errs[1]:.1e}")
        assert heat.shape == want.shape == (2, gh, gw) and max(errs) <= TOL


def test_token_merging_with_rope_is_refused_in_one_line(tmp_path, capsys):
    """`vit-export --tome` of a RoPE checkpoint: exit 2, one line, nothing written (a merged token has no one
    position to rotate by)."""
    from vit_export.cli import main

    import vit_serve

    ckpt = tmp_path / "dinov3.safetensors"
    vit_serve.save(ours_rope("dinov3", timm_rope("dinov3")), ckpt)
    out = tmp_path / "out"
    assert main([str(ckpt), "--res", "dynamic", "--tome", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "token merging is not supported with RoPE" in err, err
    assert not out.exists() or not any(out.iterdir())
