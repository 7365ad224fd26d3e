"""POST /classify?labels= and the v2 / gRPC `labels` parameter on the real gateway (uvicorn in a thread): a tiny
open_clip CLIP (random weights, `open_clip.create_model(pretrained=None)`) converted with `vit-serve convert
--zero-shot` and exported with `vit-export --text-tower`; the answers with labels equal the zero-shot head's (the
same labels) and open_clip's own recipe computed here; limits and refusals are 400s; the label cache counts hits;
the web page shows a labels box for that model (Debian's chromium, as tests/serve/test_page.py)."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
import time
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


TEMPLATES = ["a photo of a {}.", "a blurry photo of a {}.", "itap of a {}."]  # convert --templates, for zs3
CHUNK = 4  # text_chunk_size of the gateways here: prompts per text tower run


@pytest.fixture(scope="module")
def repo(tmp_path_factory, randomize) -> tuple[Path, object]:
    """(REPO, the open_clip model): zs (the --zero-shot checkpoint exported with --text-tower), zs3 (the same with
    --templates, three of them) and plain (an image-only torch checkpoint)."""
    import vit_export

    from vit_serve.cli import main as serve_main

    folder = tmp_path_factory.mktemp("labels")
    model = tiny_clip(randomize, seed=5)
    torch.save(model.state_dict(), folder / "oc.pt")
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    (folder / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    repo = folder / "repo"
    for name, extra in (("zs", []), ("zs3", ["--templates", str(folder / "templates.txt")])):
        assert serve_main(["convert", str(folder / "oc.pt"), str(folder / f"{name}.safetensors"), "--arch", ARCH,
                           "--zero-shot", str(folder / "labels.txt"), *extra]) == 0
        result = vit_export.export(folder / f"{name}.safetensors", vit_export.ExportOptions(
            out=repo, name=name, text_tower=True, formats=("onnx",)))
        assert result.ok and result.text is not None
    vit_serve.save(randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=32)),
                   repo / "plain.safetensors")
    return repo, model


@pytest.fixture(scope="module")
def gateway(repo) -> Iterator[tuple[str, object]]:
    """(HTTP URL, the app in this process) of a gateway over REPO without keys."""
    folder, _ = repo
    with live_app(settings_for(folder, default_model="zs", grpc_port=0, text_chunk_size=CHUNK)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def served(gateway, repo) -> tuple[str, str, object]:
    """(HTTP URL, gRPC address, the open_clip model)."""
    url, app = gateway
    return url, app.state.grpc.address, repo[1]


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
    assert names == ["plain", "zs", "zs3"]  # zs_text.onnx is zs's companion, not a model


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


# ---- bounded, scheduled text work (labels x templates, bytes and tokens, deadlines, hang-ups, rates, scopes) ----

def _version(app, name: str = "zs3"):
    return app.state.gateway.model(name)


def _hold_text_thread(mv) -> threading.Event:
    """A job that holds `mv`'s text tower thread until the returned event is set (the requests after it wait)."""
    release = threading.Event()

    def steps():
        release.wait(120)
        return None
        yield  # a generator: the scheduler's job

    mv.text.scheduler.submit(steps())
    _until(lambda: mv.text.scheduler.waiting == 0, "the holding job to start")
    return release


def _until(ok, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < end, f"waited {timeout} s for {what}"
        time.sleep(0.02)


def test_labels_and_the_head_converted_with_templates_agree(served, photos):
    """convert --templates: the templates travel into NAME_text.json, so ?labels= prompts as the baked head did."""
    url, _, model = served
    meta = httpx.get(f"{url}/v2/models/zs3", timeout=30).json()
    assert meta["parameters"]["text_tower"]["templates"] == TEMPLATES
    photo = photos["chelsea.jpg"]
    head = _classify(url, photo, top_k=4, model="zs3").json()
    by_labels = _classify(url, photo, top_k=4, model="zs3", labels=",".join(LABELS))
    assert by_labels.status_code == 200, by_labels.text
    assert [p["label"] for p in by_labels.json()["predictions"]] == [p["label"] for p in head["predictions"]]
    for a, b in zip(by_labels.json()["predictions"], head["predictions"], strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    # and open_clip's recipe over the three templates (build_zero_shot_classifier)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    logits = np.asarray(_v2(url, x.numpy(), model="zs3", labels=",".join(LABELS)).json()["outputs"][0]["data"])
    with torch.no_grad():
        rows = []
        for label in LABELS:
            e = torch.nn.functional.normalize(model.encode_text(open_clip.tokenize(
                [t.format(label) for t in TEMPLATES])), dim=-1).mean(0)
            rows.append(torch.nn.functional.normalize(e, dim=-1))
        image = torch.nn.functional.normalize(model.encode_image(x), dim=-1)
        ref = (model.logit_scale.exp() * image @ torch.stack(rows).T).numpy()
    np.testing.assert_allclose(logits.reshape(2, 4), ref, atol=1e-4, rtol=0)


def test_labels_are_measured_in_bytes_tokens_and_prompts(served, photos, repo):
    url, _, _ = served
    photo = photos["coffee.jpg"]
    cases = {
        "cat," + "\U0001F408" * 65: "VIT_SERVE_MAX_LABEL_BYTES",  # 65 code points, 260 UTF-8 bytes (limit 256)
        "cat," + "1234567890" * 9: "context length of 77",  # 90 digits: 90 tokens, which open_clip truncates
        "cat," + "a" * 97: "word of 97 bytes",  # one word of 97 bytes: refused before its BPE
    }
    for labels, message in cases.items():
        r = _classify(url, photo, labels=labels, model="zs3")
        assert r.status_code == 400 and message in r.json()["detail"], (labels[:20], r.text)
    x = np.zeros((1, 3, 64, 64), np.float32)
    body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}], "parameters": {"labels": ["cat", "dog\ud800"]}}
    r = httpx.post(f"{url}/v2/models/zs3/infer", content=json.dumps(body),  # "\ud800": a lone surrogate
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"], r.text
    # labels x templates: 3 labels x 3 templates over a limit of 8
    folder, _ = repo
    with live_app(settings_for(folder, default_model="zs3", max_label_prompts=8)) as (small, _app):
        r = _classify(small, photo, labels="cat,dog,bird")
        assert r.status_code == 400, r.text
        assert "3 labels x 3 templates = 9 prompts, over the limit of 8 (VIT_SERVE_MAX_LABEL_PROMPTS)" in \
            r.json()["detail"]
        assert _classify(small, photo, labels="cat,dog").status_code == 200


def test_prompts_are_encoded_a_chunk_at_a_time(gateway):
    """7 labels x 3 templates = 21 prompts: runs of at most CHUNK prompts, and the same class embeddings as in
    one run."""
    from vit_serve.runtime.text_tower import TextTower

    mv = _version(gateway[1])
    tower = mv.text
    runs: list[int] = []
    real = tower.session

    class Counting:  # the real session, its batch sizes noted
        def run(self, names, feeds):
            runs.append(len(feeds["input_ids"]))
            return real.run(names, feeds)

    labels = [f"a thing number {i}" for i in range(7)]
    other = TextTower(tower.path, 0)  # the default chunk (256): one run
    try:
        whole = other.classes(labels)
    finally:
        other.close()
    tower.session = Counting()
    try:
        chunked = tower.classes(labels, scope="chunk-test")
    finally:
        tower.session = real
    assert runs == [4, 4, 4, 4, 4, 1]
    np.testing.assert_allclose(chunked, whole, atol=1e-6, rtol=0)


def test_a_deadline_that_passes_while_labels_are_encoded_is_504(gateway, photos):
    url, app = gateway
    mv = _version(app)
    release = _hold_text_thread(mv)
    try:
        r = _classify(url, photos["coffee.jpg"], model="zs3", labels="a teal kettle,a brass lamp", timeout_ms=3000)
    finally:
        release.set()
    assert r.status_code == 504, r.text
    assert "the request's deadline has passed (while its labels were encoded" in r.json()["detail"]
    _until(lambda: mv.text.scheduler.held == 0, "the text queue to empty")
    assert mv.text.cache.get("a teal kettle") is None  # its chunks were skipped: nothing encoded, nothing cached


def test_a_client_that_hangs_up_cancels_its_text_work(gateway, photos):
    url, app = gateway
    mv = _version(app)
    host, port = url.removeprefix("http://").split(":")
    body = photos["coffee.jpg"]
    head = (f"POST /classify?model=zs3&labels=a%20green%20umbrella,a%20paper%20boat HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    release = _hold_text_thread(mv)
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(head + body)
            _until(lambda: mv.text.scheduler.held == 2, "the request's text job to queue")
        _until(lambda: mv.text.scheduler.held == 2 and _cancelled_jobs(mv) == 1, "the hang-up to cancel it")
    finally:
        release.set()
    _until(lambda: mv.text.scheduler.held == 0, "the text queue to empty")
    assert mv.text.cache.get("a green umbrella") is None and mv.text.cache.get("a paper boat") is None


def _cancelled_jobs(mv) -> int:
    return sum(job.future.cancelled() for job in list(mv.text.scheduler._heap))


def test_the_text_queue_is_bounded(repo, photos):
    folder, _ = repo
    with live_app(settings_for(folder, default_model="zs3", text_queue_size=1)) as (url, app):
        mv = _version(app)
        release = _hold_text_thread(mv)
        try:
            r = _classify(url, photos["coffee.jpg"], labels="a violin,a cello")
        finally:
            release.set()
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "VIT_SERVE_TEXT_QUEUE_SIZE" in r.json()["detail"]
        assert _classify(url, photos["coffee.jpg"], labels="a violin,a cello").status_code == 200


ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


@pytest.fixture(scope="module")
def keyed(repo, tmp_path_factory) -> Iterator[str]:
    """A gateway with two keys: Alice's with a rate (1/s, bursts of 5), Bob's without."""
    folder, _ = repo
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ALICE} name=alice rate=1 burst=5\n{BOB} name=bob\n")
    with live_app(settings_for(folder, default_model="zs3", api_keys_file=str(keys),
                               text_chunk_size=CHUNK)) as (url, _app):
        yield url


def _keyed(url: str, key: str, photo: bytes, labels: str) -> httpx.Response:
    return httpx.post(f"{url}/classify", params={"labels": labels}, content=photo,
                      headers={"Content-Type": "image/jpeg", "X-API-Key": key}, timeout=60)


def test_the_label_cache_is_each_callers_own(keyed, photos):
    url = keyed

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics", headers={"X-API-Key": BOB}).text
        return (metric(text, "vit_serve_label_cache_total", model="zs3", result="hit"),
                metric(text, "vit_serve_label_cache_total", model="zs3", result="miss"))

    photo = photos["coffee.jpg"]
    hits0, misses0 = counts()
    assert _keyed(url, BOB, photo, "a harp,a lute").status_code == 200
    assert counts() == (hits0, misses0 + 2)
    again = _keyed(url, BOB, photo, "a harp,a lute")
    assert counts() == (hits0 + 2, misses0 + 2)  # Bob's own labels: hits
    other = _keyed(url, ALICE, photo, "a harp,a lute")
    assert other.status_code == 200, other.text
    assert counts() == (hits0 + 2, misses0 + 4)  # Alice meets none of Bob's hits
    assert {p["label"]: p["score"] for p in other.json()["predictions"]} == pytest.approx(
        {p["label"]: p["score"] for p in again.json()["predictions"]}, abs=1e-6)


def test_the_prompts_count_in_the_rate_limit(keyed, photos):
    url = keyed
    photo = photos["chelsea.jpg"]
    time.sleep(5)  # Alice's bucket (1/s) full again after the test before
    r = _keyed(url, ALICE, photo, "a rowboat,a canoe,a kayak,a raft")  # 4 labels x 3 templates = 12 prompts
    assert r.status_code == 200, r.text
    after = _keyed(url, ALICE, photo, "a rowboat")  # cached: no prompts, but her bucket is 7 below zero
    assert after.status_code == 429, after.text
    assert int(after.headers["retry-after"]) >= 6
    assert _keyed(url, BOB, photo, "a rowboat").status_code == 200  # Bob has no rate


# ---- one request, one pipeline (issue 39): one repository lookup, one arrival, its task resolved once ----

def _counting(monkeypatch, owner, name: str, counts: dict[str, int]) -> None:
    """Count the calls of `owner.name` (a real object's public method, called through)."""
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def test_one_classify_with_labels_makes_one_lookup_one_arrival_and_resolves_its_task_once(gateway, photos,
                                                                                           monkeypatch):
    url, app = gateway
    mv = _version(app, "zs")
    counts: dict[str, int] = {}
    _counting(monkeypatch, app.state.gateway.repository, "get", counts)  # every lookup of a version
    for name in ("arriving", "zero_shot_task", "parse_labels"):
        _counting(monkeypatch, mv, name, counts)
    r = _classify(url, photos["chelsea.jpg"], top_k=2, labels=",".join(LABELS), model="zs")
    assert r.status_code == 200, r.text
    assert [p["label"] for p in r.json()["predictions"]] and "text;dur=" in r.headers["server-timing"]
    assert counts == {"get": 1, "arriving": 1, "zero_shot_task": 1, "parse_labels": 1}


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_one_v2_infer_with_labels_makes_one_lookup_one_arrival_and_resolves_its_task_once(served, gateway, transport,
                                                                                          monkeypatch):
    url, address, _ = served
    app = gateway[1]
    mv = _version(app, "zs")
    counts: dict[str, int] = {}
    _counting(monkeypatch, app.state.gateway.repository, "get", counts)
    for name in ("arriving", "zero_shot_task", "parse_labels"):
        _counting(monkeypatch, mv, name, counts)
    x = np.zeros((2, 3, 64, 64), np.float32)
    if transport == "http":
        r = _v2(url, x, labels=",".join(LABELS))
        assert r.status_code == 200, r.text
        logits = np.asarray(r.json()["outputs"][0]["data"])
    else:
        client = grpcclient.InferenceServerClient(address)
        try:
            inp = grpcclient.InferInput("pixel_values", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            logits = client.infer("zs", [inp], outputs=[grpcclient.InferRequestedOutput("logits")],
                                  parameters={"labels": ",".join(LABELS)}).as_numpy("logits")
        finally:
            client.close()
    assert logits.size == 2 * len(LABELS)
    assert counts == {"get": 1, "arriving": 1, "zero_shot_task": 1, "parse_labels": 1}
