"""A Triton repository written by `vit_export.export(formats=("onnx", "triton"))` for one family (SigLIP: no class
token, MAP pooling, sigmoid scores; kept to one family for CI time), parsed with Triton's own model_config
schema and served by a real tritonserver (as tests/export/test_triton.py): its Python-backend model (onnxruntime
inside) gives timm's logits and embedding (tests/family_models.py) within 1e-4, and every model carries the
manifest's embedding and scores in its "vit_serve" parameter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_models import FAMILIES, ours, reference, timm_model, triton_export

pytest.importorskip("onnxscript")
pytest.importorskip("timm")
pytest.importorskip("tritonclient.http")

TOL = 1e-4
NAME = "siglip"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import vit_serve

    d = tmp_path_factory.mktemp("triton_family")
    fam = FAMILIES["siglip"]
    ref = timm_model(fam)
    repo = triton_export(d, ours(fam, ref), NAME)
    return fam, ref, vit_serve.load(d / f"{NAME}.safetensors").eval(), repo


def test_configs_carry_embedding_and_scores(exported):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from vit_serve.manifest import TritonMeta

    _, _, model, repo = exported
    configs = sorted(repo.glob("*/config.pbtxt"))
    assert configs
    for path in configs:
        cfg = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        meta = TritonMeta.from_config(json_format.MessageToDict(cfg, preserving_proto_field_name=True), cfg.name)
        assert meta.scores == "sigmoid" and meta.embedding is not None, cfg.name
        assert (meta.embedding.kind, meta.embedding.dim, meta.embedding.normalized) == (
            "pooler_output", model.cfg.embed_dim_out, True)


def test_tritonserver_answers_as_timm(exported):
    import tritonclient.http as httpclient
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(reason)
    fam, ref, model, repo = exported
    x = torch.randn(2, 3, fam.img, fam.img, generator=torch.Generator().manual_seed(0))
    want_logits, want_emb = (t.numpy() for t in reference(fam, ref, model, x))
    with TritonServer(repo) as srv:
        print("tritonserver loaded", srv.models)
        assert f"{NAME}_py" in srv.models  # this tritonserver has no onnxruntime backend: the Python one
        client = httpclient.InferenceServerClient(srv.http_address)
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x.numpy())
        got = client.infer(f"{NAME}_py", [inp], outputs=[httpclient.InferRequestedOutput("logits"),
                                                          httpclient.InferRequestedOutput("embedding")])
    errs = (np.abs(got.as_numpy("logits") - want_logits).max(), np.abs(got.as_numpy("embedding") - want_emb).max())
    print(f"tritonserver {NAME}_py: |d logits| {errs[0]:.2e}, |d embedding| {errs[1]:.2e}")
    assert max(errs) <= TOL
