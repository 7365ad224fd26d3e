"""The `embedding` output in the Triton repository (`vit-export --outputs logits,embedding --format triton`),
served by a real tritonserver and through the gateway's `--backend triton`.

References: PyTorch's `forward_head(forward_features(x), pre_logits=True)` of the exported checkpoint on
`vit_serve.preprocess`'s pixels, Triton's own config schema (`tritonclient.grpc.model_config_pb2`) and
tritonclient (HTTP and gRPC). The Python-backend classifier and ensemble run here (this tritonserver has no
onnxruntime backend); the onnxruntime model's config is checked against the graph.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

import vit_serve

pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb
from vit_export.tritonserver import TritonServer, available

from vit_serve.preprocess import preprocess

NAME = "emb"
RES = 32
LABELS = [f"class_{i}" for i in range(5)]
TOL = 1e-4  # PyTorch vs onnxruntime inside Triton


def _outputs(repo, model: str) -> dict[str, tuple[int, ...]]:
    cfg = text_format.Parse((repo / model / "config.pbtxt").read_text(), pb.ModelConfig())
    return {o.name: tuple(o.dims) for o in cfg.output}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny):
    d = tmp_path_factory.mktemp("triton_embedding")
    result, ckpt = export_tiny(d, RES, 4, LABELS, formats=("onnx", "triton"), out=d / "exports", repo=d / "repo",
                               name=NAME, triton_ensemble="py", outputs="logits,embedding")
    assert result.ok
    return {"repo": d / "repo", "model": vit_serve.load(ckpt).eval()}


@pytest.fixture(scope="module")
def server(exported):
    reason = available()
    if reason:
        pytest.skip(f"no tritonserver here: {reason}")
    srv = TritonServer(exported["repo"], models=[f"{NAME}_py", f"{NAME}_preprocess", f"{NAME}_ensemble",
                                                 f"{NAME}_explain_py"])
    srv.start(timeout=120)
    yield srv
    srv.close()


def _want(model, images: list[bytes]) -> tuple[torch.Tensor, np.ndarray]:
    x = torch.stack([preprocess(b, model.preprocess_cfg) for b in images])
    with torch.no_grad():
        return x, model.forward_head(model.forward_features(x), pre_logits=True).numpy()


def test_the_logits_models_and_the_ensemble_have_the_embedding(exported):
    repo = exported["repo"]
    for model in (f"{NAME}_onnx", f"{NAME}_py", f"{NAME}_ensemble"):
        assert _outputs(repo, model) == {"logits": (len(LABELS),), "embedding": (192,)}, model
    assert set(_outputs(repo, f"{NAME}_explain_onnx")) == {"logits", "rollout"}
    ens = text_format.Parse((repo / f"{NAME}_ensemble" / "config.pbtxt").read_text(), pb.ModelConfig())
    step = ens.ensemble_scheduling.step[-1]
    assert dict(step.output_map) == {"logits": "logits", "embedding": "embedding"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_answers_the_embedding_of_encoded_images(exported, server, photos, protocol):
    images = list(photos.values())
    x, want = _want(exported["model"], images)
    mod = httpclient if protocol == "http" else grpcclient
    client = (httpclient.InferenceServerClient(server.http_address) if protocol == "http"
              else grpcclient.InferenceServerClient(server.grpc_url))
    inp = mod.InferInput("image", [len(images), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[b] for b in images], dtype=object))
    got = client.infer(f"{NAME}_ensemble", [inp], outputs=[mod.InferRequestedOutput("embedding")])
    err = float(np.abs(got.as_numpy("embedding") - want).max())
    print(f"{protocol}: Triton ensemble embedding vs PyTorch pre-logits max|Δ| = {err:.2e}")
    assert err <= TOL
    pix = mod.InferInput("pixel_values", list(x.shape), "FP32")
    pix.set_data_from_numpy(x.numpy())
    direct = client.infer(f"{NAME}_py", [pix], outputs=[mod.InferRequestedOutput("embedding")])
    assert float(np.abs(direct.as_numpy("embedding") - want).max()) <= TOL


def test_the_gateway_on_triton_serves_post_embed(exported, server, photos):
    from gateway_helpers import live_server

    from vit_serve.serve.settings import ServeSettings

    settings = ServeSettings(model=f"{NAME}_py", backend="triton", triton_url=server.http_url, threads=1,
                             decode_workers=2, decode="contract")
    with live_server(settings) as url:
        for name, data in photos.items():
            r = httpx.post(f"{url}/embed", files={"file": (name, data)}, timeout=30)
            assert r.status_code == 200, r.text
            _, want = _want(exported["model"], [data])
            assert r.json()["dim"] == 192
            assert float(np.abs(np.array(r.json()["embedding"]) - want[0]).max()) <= TOL
        meta = httpx.get(f"{url}/v2/models/{NAME}_py", timeout=10).json()
        assert {"name": "embedding", "datatype": "FP32", "shape": [-1, 192]} in meta["outputs"]
