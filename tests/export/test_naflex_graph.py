"""The NaFlex ONNX graph (vit_export.naflex_graph) against transformers' Siglip2VisionModel: one graph, dynamic
batch and patch budget, in onnxruntime (and OpenVINO where installed), on transformers' own processor outputs
for photos of three aspect ratios plus an extreme one at several budgets."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")

from naflex_models import siglip2_tower  # noqa: E402
from vit_export.naflex_graph import NAFLEX_INPUTS, export_naflex, naflex_info  # noqa: E402
from vit_export.parity import runtime_session  # noqa: E402

from vit_serve.checkpoints import load  # noqa: E402
from vit_serve.model import create_model  # noqa: E402

TOL = 1e-4  # measured: <= 2.1e-6 (onnxruntime) at every budget below


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("siglip2")
    ref = siglip2_tower(folder, seed=3)
    path = folder / "naflex.onnx"
    graph = export_naflex(load(folder), path)
    return ref, path, graph


def _images():
    g = np.random.default_rng(0)
    return [skimage_data.astronaut()[:, 100:400], skimage_data.coffee(), skimage_data.chelsea()[:, 75:375],
            g.integers(0, 256, (37, 1000, 3), dtype=np.uint8)]


def _feed(x) -> dict[str, np.ndarray]:
    return {"patches": x.pixel_values.numpy(), "spatial_shapes": x.spatial_shapes.numpy().astype(np.int64),
            "mask": x.pixel_attention_mask.numpy().astype(np.int64)}


def test_graph_inputs_and_ops(exported):
    _, path, graph = exported
    proto = onnx.load(str(path))
    assert [i.name for i in graph.io.inputs] == list(NAFLEX_INPUTS)
    assert graph.io.inputs[0].shape[:2] == ("batch", "max_patches") and graph.io.inputs[0].shape[2] == 768
    assert graph.info.resample_mode == "naflex" and graph.info.resolution == "dynamic" and graph.info.embedding
    assert naflex_info(proto) == {"inputs": list(NAFLEX_INPUTS), "patch_size": 16, "in_chans": 3, "max_patches": 256}
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"If", "Loop", "Resize", "NonZero"}, ops


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("n", [256, 64, 100])
def test_parity_with_hf_at_budgets_and_aspect_ratios(exported, runtime, n):
    if runtime == "openvino":
        pytest.importorskip("openvino", reason="openvino is not installed: no second runtime")
    ref, path, _ = exported
    sess = runtime_session(path, runtime)
    images = _images()
    x = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=images, return_tensors="pt")
    with torch.no_grad():
        want = ref(**x).pooler_output.numpy()
    _, emb = sess.run(None, _feed(x))
    assert np.abs(emb - want).max() <= TOL
    one = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=images[3:], return_tensors="pt")
    _, alone = sess.run(None, _feed(one))  # batch 1, and the same answer as in the batch of 4
    assert np.abs(alone[0] - emb[3]).max() <= 1e-5


def test_refuses_what_forward_patches_refuses(tmp_path):
    model = create_model("Ti/16", img_size=32, depth=1, num_classes=0).eval()
    model.set_token_merging(1)
    with pytest.raises(ValueError, match="no token merging"):
        export_naflex(model, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


def test_pipeline_writes_the_naflex_graph(exported, tmp_path):
    import vit_export

    model = load(exported[1].parent)
    result = vit_export.export(model, vit_export.ExportOptions(out=tmp_path, name="s2", naflex=True))
    assert result.ok and result.naflex is not None and result.naflex.ok
    assert result.naflex.path == tmp_path / "s2_naflex.onnx" and result.naflex.max_abs_diff <= 1e-4
    assert [t.name for t in result.naflex.graph.io.inputs] == list(NAFLEX_INPUTS)
    with pytest.raises(vit_export.OutputExistsError):
        vit_export.export(model, vit_export.ExportOptions(out=tmp_path, name="s2", naflex=True))


def test_pipeline_refuses_a_fixed_size_model(tmp_path):
    import vit_export

    model = create_model("Ti/16", img_size=32, depth=1, num_classes=3).eval()
    with pytest.raises(vit_export.OptionError, match="needs a NaFlex model"):
        vit_export.export(model, vit_export.ExportOptions(out=tmp_path, naflex=True))
    assert not any(tmp_path.iterdir())
