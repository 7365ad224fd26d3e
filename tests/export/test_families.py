"""The families people deploy (DeiT distilled, DINOv2 with registers, CLIP with projection, SigLIP with MAP)
through the dynamic-resolution ONNX export: onnxruntime and OpenVINO (a second runtime nobody here wrote) give
timm's logits and embeddings (tests/family_models.py: timm, random weights, loaded bit-exactly) within 1e-4 at
the native size and at a larger one, where timm resamples its own way (dynamic_img_size); the manifest states
the embedding and the scores. The explain graphs: test_families_explain.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_models import FAMILIES, ours, reference, timm_model

pytest.importorskip("onnxscript")
pytest.importorskip("timm")

TOL = 1e-4  # measured: <= 1.7e-6 (onnxruntime), see the printed errors
EXPORTED = ("deit", "dinov2_reg", "clip", "siglip")
EMBEDDING = {"deit": ("pre_logits", False), "dinov2_reg": ("pooler_output", False),
             "clip": ("image_embeds", True), "siglip": ("pooler_output", True)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per family: (timm model, our model, dynamic graph with logits + embedding, its manifest)."""
    from vit_export.onnx_export import export_graph
    from vit_export.sidecar import build_sidecar

    out, done = tmp_path_factory.mktemp("families"), {}
    for key in EXPORTED:
        fam = FAMILIES[key]
        ref = timm_model(fam)
        model = ours(fam, ref)
        graph = export_graph(model, out / f"{key}.onnx", res="dynamic", embedding=True, simplify=False)
        done[key] = (ref, model, graph.path, build_sidecar(model, graph.path, None, info=graph.info, io=graph.io))
    return done


def _inputs(fam, size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(size))


@pytest.mark.parametrize("key", EXPORTED)
def test_runtimes_equal_timm(exported, key):
    import onnxruntime as ort

    ref, model, path, _ = exported[key]
    fam = FAMILIES[key]
    sessions = {"onnxruntime": ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])}
    pytest.importorskip("openvino", reason="openvino is not installed: no second runtime")
    from vit_export.parity import OpenVINOSession

    sessions["openvino"] = OpenVINOSession(path)
    for size in (fam.img, fam.img + 2 * fam.options["patch_size"]):
        x = _inputs(fam, size)
        want_logits, want_emb = reference(fam, ref, model, x)
        for name, sess in sessions.items():
            logits, emb = sess.run(None, {"pixel_values": x.numpy()})
            errs = (np.abs(logits - want_logits.numpy()).max(), np.abs(emb - want_emb.numpy()).max())
            print(f"{key} {size}px {name}: max |d logits| {errs[0]:.2e}, |d embedding| {errs[1]:.2e}")
            assert emb.shape == want_emb.shape and max(errs) <= TOL


@pytest.mark.parametrize("key", EXPORTED)
def test_manifest_states_embedding_and_scores(exported, tmp_path, key):
    from vit_serve.manifest import ExportManifest

    _, model, _, manifest = exported[key]
    kind, normalized = EMBEDDING[key]
    back = ExportManifest.from_dict(manifest.to_dict())
    assert back.embedding == manifest.embedding and back.embedding.kind == kind
    assert back.embedding.normalized is normalized and back.embedding.dim == model.cfg.embed_dim_out
    assert back.embedding_dim == model.cfg.embed_dim_out
    assert back.score_fn == ("sigmoid" if key == "siglip" else "softmax")
