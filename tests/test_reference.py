"""A model's reference (vit_serve.reference, vit_serve.monitor): `vit-serve train` stores one fitted on the training
set and calibrated on the validation split, and it round-trips through the checkpoint, the export manifest, the
Triton repository's config (read with NVIDIA's model_config protobuf) and `vit-serve predict` (rows read back with
pyarrow); the scores are checked against numpy's linear algebra on the model's own embeddings; where it no longer
applies (another resolution, a new head, token merging) it is dropped, and a folder builds one for an export."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vit_serve
from vit_serve.cli import main
from vit_serve.data import build_dataset, digits_images
from vit_serve.monitor import DEFAULT_QUANTILE
from vit_serve.reference_sketch import SHRINKAGE
from vit_serve.train.augment import eval_transform

SMALL = dict(model_args=dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=2), res=(8, 8),
             steps=40, batch_size=32, lr=0.003, warmup_steps=5, translate=0.0, dropout=0.0, progress=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from vit_serve.train.config import TrainConfig
    from vit_serve.train.loop import train

    out = tmp_path_factory.mktemp("run")
    train(TrainConfig(out=str(out), **SMALL))
    return out / "model.safetensors"


@pytest.fixture(scope="module")
def model(trained):
    return vit_serve.load(trained)


def _outputs(model, split: str) -> tuple[np.ndarray, np.ndarray]:
    ds = build_dataset("digits", split, eval_transform(model.preprocess_cfg))
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    with torch.inference_mode():
        tokens = model.forward_features(x)
        return (model.forward_head(tokens, pre_logits=True).double().numpy(),
                model.forward_head(tokens).double().numpy())


def _mahalanobis(fit: np.ndarray, e: np.ndarray) -> np.ndarray:
    """d^T (Sigma + s I)^-1 d with s = SHRINKAGE x the mean eigenvalue (= trace / D), by np.linalg.solve."""
    mu = fit.mean(0)
    cov = np.cov(fit - mu, rowvar=False)
    s = SHRINKAGE * np.trace(cov) / cov.shape[0]
    d = e - mu
    return np.einsum("nd,nd->n", d, np.linalg.solve(cov + s * np.eye(len(cov)), d.T).T)


def test_training_stores_a_reference_fitted_on_train_and_calibrated_on_val(model):
    ref = model.reference
    assert ref is not None and ref.method == "mahalanobis" and ref.needs_embedding
    train_e, _ = _outputs(model, "train")
    val_e, val_l = _outputs(model, "test")
    assert ref.n_fit == len(train_e) and len(ref.scores) == len(val_e)
    np.testing.assert_allclose(ref.mean, train_e.mean(0), rtol=1e-4, atol=1e-5)
    expected = _mahalanobis(train_e, val_e)
    np.testing.assert_allclose(ref.scores, expected, rtol=2e-3, atol=1e-3)
    assert ref.threshold == pytest.approx(np.quantile(ref.scores.astype(np.float64), DEFAULT_QUANTILE))
    p = np.exp(val_l - val_l.max(1, keepdims=True))
    np.testing.assert_allclose(ref.confidences, (p / p.sum(1, keepdims=True)).max(1), rtol=1e-5)
    assert np.array_equal(ref.classes, val_l.argmax(1))


def test_the_checkpoint_round_trips_it_and_a_new_resolution_or_head_drops_it(model, trained, tmp_path):
    again = vit_serve.load(trained)
    for name in ("mean", "basis", "eigvals", "scores", "projections"):
        assert np.array_equal(getattr(again.reference, name), getattr(model.reference, name)), name
    assert again.reference.threshold == model.reference.threshold
    again.set_resolution(16, 16)
    assert again.reference is None
    other = vit_serve.load(trained)
    other.reset_head(3)
    assert other.reference is None
    assert main(["convert", str(trained), str(tmp_path / "r16.safetensors"), "--res", "16"]) == 0
    assert vit_serve.load(tmp_path / "r16.safetensors").reference is None


@pytest.fixture(scope="module")
def digit_folder(tmp_path_factory) -> Path:
    """60 held-out digits as 8x8 PNG files."""
    folder = tmp_path_factory.mktemp("digits")
    images, _ = digits_images("test")
    for i, im in enumerate(images[:60]):
        im.convert("RGB").save(folder / f"d{i:03d}.png")
    return folder


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    import vit_export

    out = tmp_path_factory.mktemp("export")
    return vit_export.export(trained, vit_export.ExportOptions(out=out / "onnx", formats="onnx,triton",
                                                               repo=out / "repo", name="digits"))


def test_the_export_manifest_carries_it_and_the_graph_gives_the_embedding_it_scores(model, exported, digit_folder):
    from vit_serve.manifest import EMBEDDING, read_manifest
    from vit_serve.monitor import ood_scores
    from vit_serve.preprocess import preprocess
    from vit_serve.runtime import LoadSpec, load

    side = read_manifest(exported.graph.path)
    assert side.reference is not None and np.array_equal(side.reference.basis, model.reference.basis)
    assert side.io.output(EMBEDDING) is not None  # added for the reference, not asked for
    assert read_manifest(exported.explain.path).reference is None
    raw = json.loads(exported.graph.manifest.read_text())
    assert raw["reference"]["version"] == 1 and len(exported.graph.manifest.read_bytes()) < 200_000
    backend = load(LoadSpec(path=str(exported.graph.path), backend="onnxruntime"))
    assert backend.info.reference is not None
    files = sorted(digit_folder.iterdir())[:16]
    x = torch.stack([preprocess(f, model.preprocess_cfg) for f in files])
    logits, emb = backend.embed(x.numpy())
    with torch.inference_mode():
        t_logits, t_emb = model.forward_embedding(x)
    np.testing.assert_allclose(logits, t_logits.numpy(), rtol=1e-4, atol=1e-4)
    got = ood_scores(backend.info.reference, logits, emb)
    want = _mahalanobis_ref(model.reference, t_emb.double().numpy())
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def _mahalanobis_ref(ref, e: np.ndarray) -> np.ndarray:
    """The reference's Gaussian at full rank, inverted by numpy: d^T (V diag(lambda) V^T + s I)^-1 d."""
    cov = ref.basis.astype(np.float64) @ np.diag(ref.eigvals.astype(np.float64)) @ ref.basis.T.astype(np.float64)
    s = SHRINKAGE * float(ref.eigvals.astype(np.float64).mean())
    d = e - ref.mean.astype(np.float64)
    return np.einsum("nd,nd->n", d, np.linalg.solve(cov + s * np.eye(len(cov)), d.T).T)


def test_the_triton_repository_carries_it_on_the_models_that_give_the_embedding(model, exported):
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from vit_serve.runtime.backends.triton import model_info

    repo = exported.options.repo
    carried = {}
    for cfg_file in sorted(Path(repo).glob("*/config.pbtxt")):
        cfg = text_format.Parse(cfg_file.read_text(), model_config_pb2.ModelConfig())
        config = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
        meta = json.loads(config["parameters"]["vit_serve"]["string_value"])
        carried[cfg_file.parent.name] = "reference" in meta
        if meta["kind"] == "logits":
            info = model_info(cfg_file.parent.name, config, str(cfg_file))
            assert info.reference is not None and np.array_equal(info.reference.mean, model.reference.mean)
    assert carried == {"digits_onnx": True, "digits_py": True, "digits_ensemble": True,
                       "digits_explain_onnx": False, "digits_explain_py": False, "digits_preprocess": False}


def test_predict_rows_carry_the_score_and_flag(model, exported, digit_folder, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "rows.parquet"
    assert main(["predict", str(exported.graph.path), str(digit_folder), "--out", str(out), "--quiet"]) == 0
    table = pq.read_table(out).to_pylist()
    assert len(table) == 60 and {"ood_score", "ood_flag"} <= set(table[0])
    from vit_serve.preprocess import preprocess

    files = [Path(r["path"]) for r in table]
    x = torch.stack([preprocess(f, model.preprocess_cfg) for f in files])
    with torch.inference_mode():
        _, emb = model.forward_embedding(x)
    want = _mahalanobis_ref(model.reference, emb.double().numpy())
    np.testing.assert_allclose([r["ood_score"] for r in table], want, rtol=1e-3, atol=1e-3)
    assert [r["ood_flag"] for r in table] == [bool(s > model.reference.threshold) for s in
                                              (r["ood_score"] for r in table)]
    csv_out = tmp_path / "rows.csv"
    assert main(["predict", str(exported.graph.path), str(digit_folder), "--out", str(csv_out), "--quiet"]) == 0
    with open(csv_out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["ood_score"]) for r in rows] == pytest.approx([r["ood_score"] for r in table], rel=1e-5)


def test_a_model_without_one_exports_and_predicts_as_before(digit_folder, tmp_path, save_tiny):
    import vit_export

    ckpt = save_tiny(tmp_path / "plain.safetensors", (32, 32), 0, [str(i) for i in range(10)])
    result = vit_export.export(ckpt, vit_export.ExportOptions(out=tmp_path / "onnx"))
    raw = json.loads(result.graph.manifest.read_text())
    assert "reference" not in raw and "embedding" not in {o["name"] for o in raw["io"]["outputs"]}
    out = tmp_path / "rows.jsonl"
    assert main(["predict", str(result.graph.path), str(digit_folder), "--out", str(out), "--quiet"]) == 0
    row = json.loads(out.read_text().splitlines()[0])
    assert "ood_score" not in row and "ood_flag" not in row


def test_an_export_at_another_resolution_drops_it_unless_a_folder_builds_one(trained, digit_folder, tmp_path):
    import vit_export

    said: list[str] = []
    plain = vit_export.export(trained, vit_export.ExportOptions(out=tmp_path / "a", res=16), progress=said.append)
    assert plain.graph.record.reference is None
    assert any("reference is not carried: it was made at 8x8" in s for s in said)
    built = vit_export.export(trained, vit_export.ExportOptions(out=tmp_path / "b", res=16,
                                                                reference_images=digit_folder))
    ref = built.graph.record.reference
    assert ref is not None and ref.n_fit == 30 and len(ref.scores) == 30
    # built as the 16x16 graph computes: its calibration scores are those of the resampled model
    resampled = vit_serve.load(trained)
    resampled.set_resolution(16, 16)
    assert not np.allclose(ref.mean, vit_serve.load(trained).reference.mean, atol=1e-3)


def test_a_folder_too_small_is_refused_in_one_line(trained, tmp_path, capsys):
    from vit_export.cli import main as export_main

    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(few / f"{i}.png")
    code = export_main([str(trained), "--out", str(tmp_path / "x"), "--reference-images", str(few)])
    err = capsys.readouterr().err
    assert code != 0 and "3 readable images; a reference needs at least 8" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    assert main(["convert", str(trained), str(tmp_path / "c.safetensors"), "--reference-images", str(few)]) == 1
    assert not (tmp_path / "c.safetensors").exists()


def test_a_real_tritonserver_serves_it_and_the_gateway_scores_its_answers(model, exported, digit_folder,
                                                                          ready_client):
    """tritonserver (the nvidia-pytriton wheel's, Python backend) loads the repository with the reference in the
    `_py` model's config; a gateway with `--backend triton` reads it from get_model_config and scores /classify
    answers with Triton's embedding, as the torch model's own embedding scores them."""
    from vit_export.tritonserver import TritonServer, available

    from vit_serve.preprocess import preprocess
    from vit_serve.serve.settings import ServeSettings

    why = available()
    if why:
        pytest.skip(f"no tritonserver here: {why}")
    files = sorted(digit_folder.iterdir())[:6]
    x = torch.stack([preprocess(f, model.preprocess_cfg) for f in files])
    with torch.inference_mode():
        _, emb = model.forward_embedding(x)
    want = _mahalanobis_ref(model.reference, emb.double().numpy())
    with TritonServer(exported.options.repo) as server:
        settings = ServeSettings(model="digits_py", backend="triton", triton_url=server.http_url, device="cpu",
                                 batch_curve=False, decode="contract")
        with ready_client(settings) as client:
            got = []
            for f in files:
                r = client.post("/classify", files={"file": (f.name, f.read_bytes(), "image/png")})
                assert r.status_code == 200, r.text
                got.append(r.json()["ood"])
            versions = client.get("/models").json()["models"][0]["versions"]
    np.testing.assert_allclose([g["score"] for g in got], want, rtol=1e-3, atol=1e-3)
    assert [g["flag"] for g in got] == [bool(s > model.reference.threshold) for s in want]
    assert versions[0]["monitoring"]["method"] == "mahalanobis"
