"""Image embeddings: POST /embed, the `embedding` output of /v2 (HTTP and gRPC) and `vit-export --outputs
logits,embedding`.

Reference: timm. A timm ViT with random weights is converted to a vit-serve checkpoint; its embedding is timm's
own `forward_head(forward_features(x), pre_logits=True)` on the pixels `vit_serve.preprocess` makes of the upload,
and its L2 normalisation is `torch.nn.functional.normalize`. The exported graph is also run by OpenVINO, a
second ONNX runtime.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gateway_helpers import LABELS, run, serving, settings_for

import vit_serve
from vit_serve.manifest import read_manifest
from vit_serve.preprocess import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PreprocessConfig, preprocess

timm = pytest.importorskip("timm")
pytest.importorskip("onnxruntime")

TOL = 1e-5
RES = (48, 48)  # square: the timm converter infers the grid from the position embeddings


@pytest.fixture(scope="module")
def timm_model(randomize):
    """timm's ViT-Ti/16, 2 blocks at 48x48, random non-trivial weights: the reference."""
    return randomize(timm.create_model("vit_tiny_patch16_224", num_classes=len(LABELS), depth=2, img_size=RES),
                     seed=5).eval()


@pytest.fixture(scope="module")
def ckpt(timm_model, tmp_path_factory):
    """The timm model as a vit-serve checkpoint (converted from its state dict), with labels and a contract."""
    from vit_serve.checkpoints import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    model = build_model(convert_timm(timm_model.state_dict(), "vit_tiny_patch16_224"))
    model.labels = list(LABELS)
    model.preprocess_cfg = PreprocessConfig(input_size=RES, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                                            interpolation="bicubic", crop_pct=0.875)
    path = tmp_path_factory.mktemp("embed") / "timm_tiny.safetensors"
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="module")
def export(ckpt, tmp_path_factory):
    """`vit_export.export(..., outputs="logits,embedding")`: NAME.onnx with both outputs."""
    import vit_export

    torch.set_num_threads(1)
    result = vit_export.export(ckpt, vit_export.ExportOptions(out=tmp_path_factory.mktemp("export"), name="emb",
                                                              outputs="logits,embedding"))
    assert result.ok
    return result


def _timm_embedding(timm_model, data: bytes, cfg: PreprocessConfig) -> np.ndarray:
    x = preprocess(data, cfg)[None]
    with torch.no_grad():
        return timm_model.forward_head(timm_model.forward_features(x), pre_logits=True)[0].numpy()


def test_the_exported_graph_has_the_embedding_and_its_parity(export, ckpt):
    from vit_serve.manifest import read_manifest

    side = read_manifest(export.onnx)
    assert [t.name for t in side.io.outputs] == ["logits", "embedding"]
    assert side.embedding_dim == 192
    assert [t.name for t in read_manifest(export.explain_onnx).io.outputs] == ["logits", "rollout"]
    rows = export.graph.parity.rows
    assert rows and all(r.embedding_max_abs is not None and r.embedding_max_abs <= 1e-4 for r in rows)
    assert "embed|Δ|" in export.graph.parity.table()
    print(export.graph.parity.table())


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_the_embedding_output_equals_timms_pre_logits(export, timm_model, runtime):
    from vit_export.parity import runtime_session

    if runtime == "openvino":
        pytest.importorskip("openvino")
    x = torch.randn(4, 3, *RES, generator=torch.Generator().manual_seed(0))
    logits, emb = runtime_session(export.onnx, runtime, 1).run(None, {"pixel_values": x.numpy()})
    with torch.no_grad():
        feats = timm_model.forward_features(x)
        want_emb = timm_model.forward_head(feats, pre_logits=True).numpy()
        want_logits = timm_model.forward_head(feats).numpy()
    err = float(np.abs(emb - want_emb).max())
    print(f"{runtime}: embedding vs timm forward_head(pre_logits=True) max|Δ| = {err:.2e}")
    assert emb.shape == (4, 192) and err <= TOL
    assert float(np.abs(logits - want_logits).max()) <= TOL


@pytest.mark.parametrize("served", ["checkpoint", "onnx"])
def test_post_embed_equals_timm(served, ckpt, export, timm_model, photos):
    model = ckpt if served == "checkpoint" else export.onnx
    cfg = vit_serve.load(ckpt).preprocess_cfg

    async def go():
        async with serving(settings_for(model)) as (client, _):
            out = {}
            for name, data in photos.items():
                plain = await client.post("/embed", files={"file": (name, data)})
                unit = await client.post("/embed?normalize=true", content=data,
                                         headers={"Content-Type": "image/jpeg"})
                out[name] = (plain, unit)
            return out

    for name, (plain, unit) in run(go()).items():
        assert plain.status_code == 200, plain.text
        body = plain.json()
        want = _timm_embedding(timm_model, photos[name], cfg)
        got = np.array(body["embedding"], np.float32)
        assert body["dim"] == 192 and body["normalized"] is False and body["model"]
        err = float(np.abs(got - want).max())
        print(f"{served} {name}: /embed vs timm max|Δ| = {err:.2e}")
        assert err <= TOL
        assert unit.status_code == 200 and unit.json()["normalized"] is True
        want_unit = F.normalize(torch.from_numpy(want), dim=-1).numpy()
        assert np.abs(np.array(unit.json()["embedding"]) - want_unit).max() <= TOL
        assert unit.json()["id"] == body["id"]
        # the checkpoint served directly and its export at the same settings: one space; normalised: another
        space = read_manifest(export.onnx).embedding_space
        assert body["embedding_fingerprint"] == space.fingerprint
        assert unit.json()["embedding_fingerprint"] == space.normalized_as(True).fingerprint != space.fingerprint


def test_a_model_without_the_embedding_output_answers_400(tiny_onnx, photos):
    async def go():
        async with serving(settings_for(tiny_onnx)) as (client, _):
            meta = await client.get("/v2/models/tiny")
            return await client.post("/embed", files={"file": ("x.jpg", next(iter(photos.values())))}), meta

    r, meta = run(go())
    assert r.status_code == 400
    assert "--outputs logits,embedding" in r.json()["detail"]
    assert [o["name"] for o in meta.json()["outputs"]] == ["logits", "rollout"]


def test_v2_embedding_output_with_tritonclient_http_and_grpc(export, timm_model, photos):
    """The `embedding` output over /v2 (tritonclient.http, binary) and gRPC (tritonclient.grpc, with the rollout in
    the same request: two passes), against timm."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from gateway_helpers import live_app

    cfg = vit_serve.load(export.source_checkpoint).preprocess_cfg
    want = np.stack([_timm_embedding(timm_model, b, cfg) for b in photos.values()])
    images = np.array(list(photos.values()), dtype=object)
    with live_app(settings_for(export.onnx, grpc_port=0)) as (url, app):
        meta = httpclient.InferenceServerClient(url[len("http://"):]).get_model_metadata("emb")
        assert {"name": "embedding", "datatype": "FP32", "shape": [-1, 192]} in meta["outputs"]
        assert meta["parameters"]["embedding_fingerprint"] == read_manifest(export.onnx).embedding_space.fingerprint
        inp = httpclient.InferInput("image", [len(images)], "BYTES")
        inp.set_data_from_numpy(images, binary_data=True)
        got = httpclient.InferenceServerClient(url[len("http://"):]).infer(
            "emb", [inp], outputs=[httpclient.InferRequestedOutput("embedding", binary_data=True)])
        assert np.abs(got.as_numpy("embedding") - want).max() <= TOL
        assert got.as_numpy("logits") is None  # only what was asked for

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{app.state.grpc.port}")
        ginp = grpcclient.InferInput("image", [len(images)], "BYTES")
        ginp.set_data_from_numpy(images)
        both = client.infer("emb", [ginp], outputs=[grpcclient.InferRequestedOutput("embedding"),
                                                    grpcclient.InferRequestedOutput("rollout")])
        assert np.abs(both.as_numpy("embedding") - want).max() <= TOL
        assert both.as_numpy("rollout").shape == (len(images), RES[0] // 16, RES[1] // 16)
        client.close()


def test_vit_export_cli_outputs_flag(ckpt, tmp_path, capsys):
    from vit_export.cli import main

    assert main([str(ckpt), "--out", str(tmp_path), "--name", "cli", "--outputs", "logits,embedding"]) == 0
    assert "embed|Δ|" in capsys.readouterr().out
    for bad in (["--outputs", "embedding"], ["--outputs", "logits,pooled"],
                ["--outputs", "logits,embedding", "--format", "tensorrt", "--name", "x"]):
        try:
            code = main([str(ckpt), "--out", str(tmp_path / "bad"), *bad])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        assert code != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "outputs" in err, err
    assert not (tmp_path / "bad").exists()
