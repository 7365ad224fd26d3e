"""POST /classify?labels= and the v2 / gRPC `labels` parameter on the real gateway (uvicorn in a thread): a tiny
open_clip CLIP (random weights, `open_clip.create_model(pretrained=None)`) converted with `vit-serve convert
--zero-shot` and exported with `vit-export --text-tower`; the answers with labels equal the zero-shot head's (the
same labels) and open_clip's own recipe computed here; limits and refusals are 400s; the label cache counts hits;
the web page shows a labels box for that model (Debian's chromium, as tests/serve/test_page.py)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import live_app, metric, settings_for

import vit_serve

open_clip = pytest.importorskip("open_clip")
grpcclient = pytest.importorskip("tritonclient.grpc")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "export"))
from test_text_tower import ARCH, tiny_clip  # noqa: E402

LABELS = ["tabby cat", "golden retriever", "a red car", "lighthouse"]
TEMPLATE = "a photo of a {}."  # convert --zero-shot's default, and the text manifest's


@pytest.fixture(scope="module")
def served(tmp_path_factory, randomize) -> Iterator[tuple[str, str, object]]:
    """(HTTP URL, gRPC address, the open_clip model): REPO holds zs (the --zero-shot checkpoint exported with
    --text-tower) and plain (an image-only torch checkpoint)."""
    import vit_export

    from vit_serve.cli import main as serve_main

    folder = tmp_path_factory.mktemp("labels")
    model = tiny_clip(randomize, seed=5)
    torch.save(model.state_dict(), folder / "oc.pt")
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    assert serve_main(["convert", str(folder / "oc.pt"), str(folder / "zs.safetensors"), "--arch", ARCH,
                       "--zero-shot", str(folder / "labels.txt")]) == 0
    repo = folder / "repo"
    result = vit_export.export(folder / "zs.safetensors", vit_export.ExportOptions(out=repo, name="zs",
                                                                                   text_tower=True))
    assert result.ok and result.text is not None
    vit_serve.save(randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=32)),
                   repo / "plain.safetensors")
    with live_app(settings_for(repo, default_model="zs", grpc_port=0)) as (url, app):
        yield url, app.state.grpc.address, model


def _classify(url: str, photo: bytes, **params) -> httpx.Response:
    return httpx.post(f"{url}/classify", params=params, content=photo, headers={"Content-Type": "image/jpeg"},
                      timeout=60)


def _recipe(model, x: torch.Tensor, labels: list[str]) -> np.ndarray:
    """open_clip's zero-shot recipe (zero_shot_classifier.build_zero_shot_classifier, CLIP.forward's logits)."""
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.encode_text(open_clip.tokenize(
            [TEMPLATE.format(c) for c in labels])), dim=-1)
        text = torch.nn.functional.normalize(text, dim=-1)  # the mean of one template, renormalised
        image = torch.nn.functional.normalize(model.encode_image(x), dim=-1)
        return (model.logit_scale.exp() * image @ text.T).numpy()


def _v2(url: str, x: np.ndarray, model: str = "zs", **parameters) -> httpx.Response:
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": [{"name": "logits"}], "parameters": parameters}
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def test_labels_equal_the_zero_shot_checkpoint_and_open_clips_recipe(served, photos):
    url, _, model = served
    photo = photos["chelsea.jpg"]
    head = _classify(url, photo, top_k=4).json()
    by_labels = _classify(url, photo, top_k=4, labels=",".join(LABELS))
    assert by_labels.status_code == 200, by_labels.text
    answer = by_labels.json()
    assert [(p["label"], p["index"]) for p in answer["predictions"]] == [
        (p["label"], p["index"]) for p in head["predictions"]]
    for a, b in zip(answer["predictions"], head["predictions"], strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    assert "text;dur=" in by_labels.headers["server-timing"]

    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    logits = np.asarray(_v2(url, x.numpy(), labels=",".join(LABELS)).json()["outputs"][0]["data"]).reshape(3, 4)
    own = np.asarray(_v2(url, x.numpy()).json()["outputs"][0]["data"]).reshape(3, 4)
    ref = _recipe(model, x, LABELS)
    print(f"?labels= logits vs the zero-shot head: {np.abs(logits - own).max():.2e}; vs open_clip's recipe "
          f"{np.abs(logits - ref).max():.2e}")
    np.testing.assert_allclose(logits, own, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)


def test_v2_classification_and_grpc_take_labels(served):
    url, address, model = served
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)).numpy()
    labels = ["a kingfisher", "a heron", "a puffin"]
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "outputs": [{"name": "logits", "parameters": {
                            "classification": 2}}], "parameters": {"labels": labels}}
    top = httpx.post(f"{url}/v2/models/zs/infer", json=body, timeout=60).json()["outputs"][0]
    assert top["shape"] == [2, 2] and all(item.split(":")[2] in labels for item in top["data"])
    client = grpcclient.InferenceServerClient(address)
    try:
        inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("zs", [inp], outputs=[grpcclient.InferRequestedOutput("logits")],
                              parameters={"labels": ",".join(labels)})
    finally:
        client.close()
    grpc_logits = result.as_numpy("logits")
    http = np.asarray(_v2(url, x, labels=",".join(labels)).json()["outputs"][0]["data"]).reshape(2, 3)
    np.testing.assert_allclose(grpc_logits, http, atol=1e-6, rtol=0)
    np.testing.assert_allclose(grpc_logits, _recipe(model, torch.from_numpy(x), labels), atol=1e-4, rtol=0)


def test_limits_and_models_without_a_text_tower_answer_400(served, photos):
    url, _, _ = served
    photo = photos["coffee.jpg"]
    cases = {
        ",".join(f"label {i}" for i in range(65)): "VIT_SERVE_MAX_LABELS",  # the default limit, 64
        "cat," + "x" * 101: "VIT_SERVE_MAX_LABEL_CHARS",  # the default limit, 100
        " , ,": "labels is empty",
        "cat,dog,cat": "given twice",
    }
    for labels, message in cases.items():
        r = _classify(url, photo, labels=labels)
        assert r.status_code == 400 and message in r.json()["detail"], (labels[:20], r.text)
    r = _classify(url, photo, labels="cat,dog", model="plain")
    assert r.status_code == 400 and "no text tower" in r.json()["detail"]
    r = _classify(url, photo, labels="cat,dog", explain="true")
    assert r.status_code == 400 and "GET /explain?id=" in r.json()["detail"]
    x = np.zeros((1, 3, 32, 32), np.float32)
    r = _v2(url, x, model="plain", labels="cat,dog")
    assert r.status_code == 400 and "no text tower" in r.json()["error"]
    names = [m["name"] for m in httpx.get(f"{url}/models").json()["models"]]
    assert names == ["plain", "zs"]  # zs_text.onnx is zs's companion, not a model


def test_the_label_cache_counts_hits(served, photos):
    url, _, _ = served

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics").text
        return (metric(text, "vit_serve_label_cache_total", model="zs", result="hit"),
                metric(text, "vit_serve_label_cache_total", model="zs", result="miss"))

    hits0, misses0 = counts()
    first = _classify(url, photos["coffee.jpg"], labels="a mug of coffee,a teapot").json()
    assert counts() == (hits0, misses0 + 2)
    again = _classify(url, photos["coffee.jpg"], labels="a teapot,a mug of coffee").json()
    assert counts() == (hits0 + 2, misses0 + 2)
    assert {p["label"]: p["score"] for p in first["predictions"]} == pytest.approx(
        {p["label"]: p["score"] for p in again["predictions"]}, abs=1e-7)


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (the system package; nothing is downloaded)")
def test_the_page_has_a_labels_box_for_a_model_with_a_text_tower(served, photos, tmp_path):
    playwright_api = pytest.importorskip("playwright.sync_api")
    from test_page import CHROMIUM_ARGS

    url, _, _ = served
    path = tmp_path / "coffee.jpg"
    path.write_bytes(photos["coffee.jpg"])
    labels = "a mug of coffee, a teapot, a red car"
    expected = _classify(url, photos["coffee.jpg"], top_k=5, labels=labels).json()
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("#labels-box:not([hidden])")  # zs, the default model, has a text tower
            page.fill("#labels", labels)
            page.set_input_files("#file", str(path))
            page.wait_for_function("document.querySelectorAll('#predictions li').length === 3")
            bars = page.eval_on_selector_all("#predictions li", "items => items.map(li => ["
                                             "li.querySelector('.label').textContent, Number(li.dataset.index)])")
            assert bars == [[p["label"], p["index"]] for p in expected["predictions"]]
            assert "zero-shot" in page.inner_text("#results-title")
            page.select_option("#model-picker", "plain")
            page.wait_for_selector("#labels-box", state="hidden")  # no text tower
            assert errors == []
        finally:
            browser.close()
