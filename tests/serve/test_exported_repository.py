"""`vit-serve serve MODEL_REPO` on the Triton repository `vit-export --format triton` writes (the quickstart's
`runs/quickstart/model_repo`): the real exporter into a folder, the real gateway app (create_app, Starlette's
TestClient) over it. Reference: the same export's flat ONNX files (`exports/NAME.onnx`, what the quickstart serves)
served by a second gateway: the repository's NAME_onnx answers /classify, /explain and /v2 infer as they do. The
model names are the repository's folder names, as Triton lists them; the Python-backend and ensemble models are
listed with why the gateway does not serve them."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_helpers import LABELS

from vit_serve.runtime.discovery import scan
from vit_serve.serve.settings import ServeSettings

RES = 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny) -> tuple[Path, Path]:
    """(exports/tiny.onnx, model_repo): `vit_export.export(formats=onnx,triton)` of a tiny random checkpoint."""
    root = tmp_path_factory.mktemp("quick")
    result, _ = export_tiny(root, RES, 5, LABELS, name="tiny", formats=("onnx", "triton"),
                            out=root / "exports", repo=root / "model_repo")
    assert result.ok
    return result.onnx, root / "model_repo"


def test_scan_pairs_model_onnx_with_its_sidecar_and_skips_tritons_own_models(exported):
    _, repo = exported
    entries = scan(repo)
    triton_names = sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
    assert sorted(entries) == triton_names  # every model Triton lists, under Triton's name
    assert sorted(n for n, e in entries.items() if not e.skipped) == ["tiny_onnx"]
    onnx = entries["tiny_onnx"]
    assert onnx.error is None and onnx.versions[1].path == repo / "tiny_onnx" / "1" / "model.onnx"
    assert onnx.config.max_batch == 16  # its config.pbtxt's max_batch_size
    for name in ("tiny_py", "tiny_explain_py", "tiny_preprocess"):
        assert entries[name].skipped and "a Triton Python-backend model" in entries[name].error
    assert "ONNX sibling tiny_onnx" in entries["tiny_py"].error
    assert "a Triton ensemble" in entries["tiny_ensemble"].error
    assert "tiny_onnx" in entries["tiny_ensemble"].error
    assert entries["tiny_explain_onnx"].skipped and "explain graph of tiny_onnx" in entries["tiny_explain_onnx"].error


def _answers(client, image: bytes, model: str | None) -> dict:
    query = f"&model={model}" if model else ""
    files = {"file": ("coffee.jpg", image, "image/jpeg")}
    classify = client.post(f"/classify?top_k=3{query}", files=files)
    explain = client.post(f"/explain?format=json{query}", files=files)
    assert classify.status_code == 200, classify.text
    assert explain.status_code == 200, explain.text
    return {"predictions": classify.json()["predictions"],
            "map": explain.json()["map"], "grid": explain.json()["grid"]}


def test_the_gateway_serves_the_repository_its_exporter_writes(exported, photos, ready_client):
    onnx, repo = exported
    image = photos["coffee.jpg"]
    with ready_client(ServeSettings(model=str(onnx), device="cpu", threads=1)) as flat:
        want = _answers(flat, image, None)
        pixels = [[[[0.25] * RES] * RES] * 3]
        body = {"inputs": [{"name": "pixel_values", "shape": [1, 3, RES, RES], "datatype": "FP32",
                            "data": pixels}]}
        want_v2 = flat.post("/v2/models/tiny/infer", json=body).json()["outputs"]
    with ready_client(ServeSettings(model=str(repo), device="cpu", threads=1)) as client:
        assert client.get("/readyz").status_code == 200
        assert _answers(client, image, "tiny_onnx") == want
        assert _answers(client, image, None) == want  # the only model it serves is the default
        got_v2 = client.post("/v2/models/tiny_onnx/infer", json=body)
        assert got_v2.status_code == 200, got_v2.text
        assert got_v2.json()["outputs"] == want_v2
        index = {r["name"]: r for r in client.post("/v2/repository/index", json={}).json()}
        assert sorted(index) == sorted(p.name for p in repo.iterdir() if (p / "config.pbtxt").is_file())
        assert index["tiny_onnx"]["state"] == "READY"
        for name in ("tiny_py", "tiny_explain_py", "tiny_preprocess", "tiny_ensemble", "tiny_explain_onnx"):
            assert index[name]["state"] == "UNAVAILABLE"
            assert "tritonserver" in index[name]["reason"] or "explain graph of" in index[name]["reason"]
        assert "ONNX sibling tiny_onnx here" in index["tiny_py"]["reason"]
        assert client.post("/classify?model=tiny_py", files={"file": ("c.jpg", image, "image/jpeg")}
                           ).status_code == 503


def test_an_engine_without_its_manifest_is_left_to_triton(exported, tmp_path):
    """With an engine (its bytes are never read by a scan), `write_repository` copies the plan alone: the gateway
    cannot serve it without its manifest, and says so."""
    from vit_export.triton_repo import write_repository

    onnx, _ = exported
    plan = tmp_path / "model_sm90.plan"
    plan.write_bytes(b"\0" * 16)
    engine = {"path": plan, "compute_capability": "90", "file": plan.name, "precision": "fp16", "batch": [1, 8, 16]}
    write_repository(onnx, onnx.with_name("tiny_explain.onnx"), tmp_path / "repo", "tiny", engine)
    entries = scan(tmp_path / "repo")
    assert entries["tiny_trt"].skipped == "engine" and not entries["tiny_trt"].versions
    assert "TensorRT engine without its manifest" in entries["tiny_trt"].error
    assert "ONNX sibling tiny_onnx" in entries["tiny_trt"].error
    assert "(tiny_preprocess -> tiny_trt)" in entries["tiny_ensemble"].error
    assert sorted(n for n, e in entries.items() if not e.skipped) == ["tiny_onnx"]


def test_predict_takes_the_repository_too(exported, photos, tmp_path):
    """`vit-serve predict MODEL_REPO SRC`: the one model the gateway serves there, no --model needed; a skipped
    one named with --model is one line with why."""
    from vit_serve.cli import main
    from vit_serve.predict import resolve_model

    _, repo = exported
    assert resolve_model(str(repo)).name == "tiny_onnx"
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "coffee.jpg").write_bytes(photos["coffee.jpg"])
    assert main(["predict", str(repo), str(tmp_path / "imgs"), "--out", str(tmp_path / "p.jsonl"), "--quiet"]) == 0
    with pytest.raises(ValueError, match="a Triton Python-backend model"):
        resolve_model(str(repo), "tiny_py")
