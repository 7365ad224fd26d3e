"""The web page at / in headless Chromium, against the real gateway (uvicorn in a thread, tiny random ViTs with
labels): upload a real photo, read the bars and the overlay, see the server's errors, and pick a model of a
repository (GET /models), each answer compared with the same request made directly with httpx.

Chromium is the system one (`chromium` on PATH, e.g. Debian's package); no browser is ever downloaded. Set
VIT_SERVE_SCREENSHOT_DIR to keep the screenshot.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
from gateway_helpers import live_server, settings_for
from PIL import Image

import vit_serve

playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
skdata = pytest.importorskip("skimage.data", reason="scikit-image (the test photo) is not installed")

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (install the system package, e.g. "
                                                         "apt-get install chromium; no browser is downloaded)")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LABELS = ["tabby cat", "espresso", "golden retriever", "red fox", "teapot", "lighthouse", "sunflower",
          "steam locomotive", "harbor seal", "origami crane"]
BIRDS = ["heron", "kingfisher", "puffin", "wren", "barn owl"]
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def server(tmp_path_factory, randomize) -> Iterator[str]:
    """The gateway's base URL: uvicorn in a background thread serving a 2-block Ti/16 at 32x32 with 10 labels."""
    folder = tmp_path_factory.mktemp("page")
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=32), seed=3)
    model.labels = list(LABELS)
    ckpt = folder / "pets.safetensors"
    vit_serve.save(model, ckpt)
    with live_server(settings_for(ckpt, backend="torch", decode_workers=1)) as url:
        yield url


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    """A real photo (scikit-image's chelsea, 451x300) as a JPEG file."""
    path = tmp_path_factory.mktemp("photo") / "chelsea.jpg"
    Image.fromarray(skdata.chelsea()).save(path, quality=90)
    return path


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory, randomize) -> Iterator[str]:
    """A gateway serving a repository of three models, --default-model pets, --version-policy all:
    pets.safetensors (as `server`'s, 32x32, 10 labels), birds/1 and birds/2 (other weights, 5 other labels,
    32x48) and broken.safetensors (not a checkpoint), which fails to load."""
    folder = tmp_path_factory.mktemp("page_repo")
    pets = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=32), seed=3)
    pets.labels = list(LABELS)
    vit_serve.save(pets, folder / "pets.safetensors")
    for version, seed in ((1, 4), (2, 5)):
        birds = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=5, img_size=(32, 48)), seed=seed)
        birds.labels = list(BIRDS)
        (folder / "birds" / str(version)).mkdir(parents=True)
        vit_serve.save(birds, folder / "birds" / str(version) / "model.safetensors")
    (folder / "broken.safetensors").write_bytes(b"not a checkpoint")
    # store_size 1: a later upload evicts the page's image, so that the page has to send it again (POST /explain)
    settings = settings_for(folder, decode_workers=1, default_model="pets", version_policy="all", store_size=1)
    with live_server(settings) as url:
        yield url


@contextmanager
def _open_page(url: str) -> Iterator:
    """A fresh headless Chromium page on url/; it records JS errors, requests off the server and the API requests
    it makes (method, path, query). The browser is closed on the way out."""
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 900})
            pg = context.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            foreign: list[str] = []
            api: list[tuple[str, str, dict[str, list[str]]]] = []

            def on_request(r) -> None:
                if not r.url.startswith((url, "blob:", "data:")):
                    foreign.append(r.url)
                elif r.url.startswith(url):
                    parts = urlsplit(r.url)
                    api.append((r.method, parts.path, parse_qs(parts.query)))

            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("request", on_request)
            pg.goto(url + "/")
            pg.errors, pg.foreign, pg.api = errors, foreign, api
            yield pg
        finally:
            browser.close()


@pytest.fixture
def page(server):
    """The page on the single-model server; fails the test on any JS error or any request off the server."""
    with _open_page(server) as pg:
        yield pg


@pytest.fixture
def repo_page(repo_server):
    with _open_page(repo_server) as pg:
        yield pg


def _screenshot(pg, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    pg.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("VIT_SERVE_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / name)
    return path


def _bars(pg) -> list[dict]:
    return pg.eval_on_selector_all("#predictions li", """items => items.map(li => ({
        label: li.querySelector('.label').textContent,
        index: Number(li.dataset.index),
        pct: li.querySelector('.pct').textContent,
        width: parseFloat(li.querySelector('.fill').style.width),
        visible: li.querySelector('.fill').getBoundingClientRect().width > 0,
    }))""")


def _wait_overlay(pg, previous: str | None = None) -> dict:
    """Waits for the overlay <img> to hold a decoded image (a new one when `previous` is its old src)."""
    pg.wait_for_function(
        "prev => { const img = document.getElementById('overlay');"
        " return img.src && img.src !== prev && img.complete && img.naturalWidth > 0; }",
        arg=previous or "")
    return pg.eval_on_selector("#overlay", "img => ({src: img.src, w: img.naturalWidth, h: img.naturalHeight, "
                                           "alt: img.alt})")


def _assert_drawn(pg, overlay: dict, crop: tuple[int, int]) -> None:
    """The overlay came at the size the page asked for (its last GET / POST /explain?size=), larger than the model's
    input crop (W, H), the crop's aspect kept."""
    size = int([q for _, path, q in pg.api if path == "/explain"][-1]["size"][0])
    scale = size / max(crop)
    assert size > max(crop)
    assert (overlay["w"], overlay["h"]) == (round(crop[0] * scale), round(crop[1] * scale))


def test_upload_shows_the_top5_and_the_attention_overlay(server, page, photo, tmp_path):
    expected = httpx.post(f"{server}/classify", params={"top_k": 5},
                          files={"file": ("chelsea.jpg", photo.read_bytes(), "image/jpeg")}).json()
    assert [p["label"] for p in expected["predictions"]] != []  # the API answers before the page is judged

    assert page.get_attribute("#file", "accept") == "image/*"
    assert page.inner_text("label[for=file]").strip()  # the file input has a visible label
    page.wait_for_function("document.getElementById('model').textContent.includes('pets v1')")
    assert page.is_hidden("#model-choice")  # one model, one version: nothing to pick
    page.set_input_files("#file", str(photo))
    page.wait_for_function("document.querySelectorAll('#predictions li').length === 5")

    bars = _bars(page)
    assert [b["label"] for b in bars] == [p["label"] for p in expected["predictions"]]
    assert [b["index"] for b in bars] == [p["index"] for p in expected["predictions"]]
    assert all(b["label"] in LABELS for b in bars)
    for bar, pred in zip(bars, expected["predictions"], strict=True):
        assert bar["pct"].endswith("%")
        assert float(bar["pct"][:-1]) == pytest.approx(100 * pred["score"], rel=0.05, abs=0.06)
        assert bar["width"] == pytest.approx(100 * pred["score"], abs=0.01)
        assert bar["visible"]
    widths = [b["width"] for b in bars]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]
    assert page.is_hidden("#error")
    assert f"{expected['model']} v{expected['version']}" in page.inner_text("#meta")

    overlay = _wait_overlay(page)
    _assert_drawn(page, overlay, (32, 32))  # the map over the model-input crop, at the size it is shown
    assert page.is_hidden("#ood")  # no reference, no OOD score in the answer
    assert "ood" not in expected
    # The torch backend answers every method and setting: nothing is disabled.
    assert page.eval_on_selector_all("#upload-form option", "opts => opts.filter(o => o.disabled).length") == 0
    assert page.is_hidden("#explain-note")
    assert overlay["src"].startswith("blob:")
    assert bars[0]["label"] in overlay["alt"]
    original = page.eval_on_selector("#original", "img => [img.naturalWidth, img.naturalHeight, img.alt]")
    assert original[:2] == [451, 300]  # the upload itself, from a local object URL
    assert "chelsea.jpg" in original[2]
    assert page.is_visible("#overlay") and page.is_visible("#original")
    # side by side: same row, the overlay to the right of the photo
    boxes = [page.eval_on_selector(s, "e => e.getBoundingClientRect().toJSON()") for s in ("#original", "#overlay")]
    assert boxes[1]["x"] > boxes[0]["x"] + boxes[0]["width"] - 1 and abs(boxes[1]["y"] - boxes[0]["y"]) < 1

    shot = _screenshot(page, tmp_path, "page.png")
    assert Image.open(shot).size[0] == 1100

    # Another head fusion: the page asks for a new map and shows it.
    page.select_option("#head-fusion", "max")
    changed = _wait_overlay(page, previous=overlay["src"])
    _assert_drawn(page, changed, (32, 32))
    assert "head fusion max" in page.inner_text("#overlay-caption")
    # Gradient rollout (the torch backend has it).
    page.select_option("#method", "grad_rollout")
    grad = _wait_overlay(page, previous=changed["src"])
    _assert_drawn(page, grad, (32, 32))
    assert "Gradient rollout" in page.inner_text("#overlay-caption")
    assert page.is_hidden("#overlay-error")

    assert page.errors == [] and page.foreign == []


def _drop(page, name: str, data: bytes, mime: str) -> None:
    """Drops a file on the drop zone the way a browser does (a DataTransfer holding a File)."""
    page.eval_on_selector("#drop-zone", """(zone, [name, b64, mime]) => {
        const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], name, {type: mime}));
        for (const type of ['dragenter', 'dragover', 'drop']) {
            zone.dispatchEvent(new DragEvent(type, {dataTransfer: dt, bubbles: true, cancelable: true}));
        }
    }""", [name, base64.b64encode(data).decode(), mime])


def test_invalid_files_show_the_servers_message(server, page, photo, tmp_path):
    cases = [("notes.txt", b"not an image at all\n", "text/plain"),  # unsupported media type
             ("broken.jpg", b"\xff\xd8\xff\xe0 this is no JPEG", "image/jpeg")]  # claims to be an image
    for name, data, mime in cases:
        api = httpx.post(f"{server}/classify", params={"top_k": 5}, files={"file": (name, data, mime)})
        assert 400 <= api.status_code < 500
        detail = api.json()["detail"]
        assert isinstance(detail, str) and detail

        page.set_input_files("#file", files=[{"name": name, "mimeType": mime, "buffer": data}])
        page.wait_for_selector("#error:not([hidden])")
        assert page.inner_text("#error").strip() == detail
        assert page.get_attribute("#error", "role") == "alert"
        assert page.is_hidden("#results")

    # A good image by drag and drop clears the error; a bad one dropped afterwards shows it again.
    buf = io.BytesIO()
    Image.open(photo).resize((96, 64)).save(buf, format="PNG")
    _drop(page, "small.png", buf.getvalue(), "image/png")
    page.wait_for_function("document.querySelectorAll('#predictions li').length === 5")
    assert page.is_hidden("#error")
    _wait_overlay(page)
    _drop(page, "notes.txt", b"still not an image", "text/plain")
    page.wait_for_selector("#error:not([hidden])")
    assert "text/plain" in page.inner_text("#error")
    assert page.is_hidden("#results") and page.is_hidden("#images")  # no stale results beside the error
    _screenshot(page, tmp_path, "page_error.png")

    assert page.errors == [] or all("status of 4" in e for e in page.errors)  # Chromium logs failed fetches
    assert page.foreign == []


def _options(pg) -> list[dict]:
    return pg.eval_on_selector_all("#model-picker option", """opts => opts.map(o => ({
        value: o.value, text: o.textContent, title: o.title, disabled: o.disabled, selected: o.selected}))""")


def _classify(url: str, photo: Path, **params) -> dict:
    r = httpx.post(f"{url}/classify", params={"top_k": 5, **params},
                   files={"file": (photo.name, photo.read_bytes(), "image/jpeg")}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_bars(pg, expected: dict) -> None:
    bars = _bars(pg)
    assert [(b["label"], b["index"]) for b in bars] == [(p["label"], p["index"]) for p in expected["predictions"]]
    for bar, pred in zip(bars, expected["predictions"], strict=True):
        assert bar["width"] == pytest.approx(100 * pred["score"], abs=0.01)


def _since(pg, start: int, path: str) -> list[dict[str, list[str]]]:
    """The query of each request to `path` the page made since pg.api[start]."""
    return [q for _, p, q in pg.api[start:] if p == path]


def test_the_model_picker_lists_the_repository_and_every_request_names_the_pick(repo_server, repo_page, photo,
                                                                                 tmp_path):
    url, page = repo_server, repo_page
    listing = httpx.get(f"{url}/models").json()
    by_name = {m["name"]: m for m in listing["models"]}
    assert sorted(by_name) == ["birds", "broken", "pets"] and listing["default_model"] == "pets"
    broken = by_name["broken"]["versions"][0]
    assert broken["state"] == "UNAVAILABLE" and broken["reason"]

    page.wait_for_function("document.querySelectorAll('#model-picker option').length === 5")
    assert page.is_visible("#model-picker")
    options = {o["value"]: o for o in _options(page)}
    # the listing's order: a model with one version is one choice; one with several, its newest then each
    assert list(options) == [v for m in listing["models"] for v in (
        [m["name"]] if len(m["versions"]) == 1
        else [m["name"], *(f"{m['name']}/{v['version']}" for v in m["versions"])])]
    assert list(options) != ["pets"] and set(options) == {"birds", "birds/1", "birds/2", "broken", "pets"}
    assert [v for v, o in options.items() if o["selected"]] == ["pets"]  # the default model, not the first one
    assert [v for v, o in options.items() if o["disabled"]] == ["broken"]
    assert "UNAVAILABLE" in options["broken"]["text"] and options["broken"]["title"] == broken["reason"]
    assert "newest (v2)" in options["birds"]["text"] and "READY" in options["birds/1"]["text"]
    assert "pets v1" in page.inner_text("#model")

    # The default model answers first; the page names it.
    start = len(page.api)
    page.set_input_files("#file", str(photo))
    page.wait_for_function("document.getElementById('meta').textContent.includes('pets v1')")
    _assert_bars(page, _classify(url, photo, model="pets"))
    first = _wait_overlay(page)
    _assert_drawn(page, first, (32, 32))
    assert _since(page, start, "/classify") == [{"top_k": ["5"], "model": ["pets"]}]

    # Picking birds re-classifies the image chosen: its newest version, the same answer as the API's.
    start = len(page.api)
    page.select_option("#model-picker", "birds")
    page.wait_for_function("document.getElementById('meta').textContent.includes('birds v2')")
    newest = _classify(url, photo, model="birds")
    assert newest["version"] == "2"
    _assert_bars(page, newest)
    assert all(b["label"] in BIRDS for b in _bars(page))
    overlay = _wait_overlay(page, previous=first["src"])
    _assert_drawn(page, overlay, (48, 32))  # birds' input crop, 32x48
    assert page.inner_text("#overlay-caption").endswith("by birds v2")
    assert _since(page, start, "/classify") == [{"top_k": ["5"], "model": ["birds"]}]
    explains = _since(page, start, "/explain")
    assert explains and all(q["model"] == ["birds"] and "version" not in q for q in explains)
    assert "birds v2" in page.inner_text("#model")

    # A version picked by the user: ?version= on every request, and that version's answer.
    start = len(page.api)
    page.select_option("#model-picker", "birds/1")
    page.wait_for_function("document.getElementById('meta').textContent.includes('birds v1')")
    old = _classify(url, photo, model="birds", version="1")
    assert [p["score"] for p in old["predictions"]] != [p["score"] for p in newest["predictions"]]
    _assert_bars(page, old)
    overlay = _wait_overlay(page, previous=overlay["src"])
    assert page.inner_text("#overlay-caption").endswith("by birds v1")
    assert _since(page, start, "/classify") == [{"top_k": ["5"], "model": ["birds"], "version": ["1"]}]
    assert [(q["model"], q["version"]) for q in _since(page, start, "/explain")] == [(["birds"], ["1"])]

    # The server forgets the image (another upload evicts it): the page sends it again to the same pick.
    _classify(url, photo, model="pets")  # store_size 1: the pets crop evicts birds' one
    start = len(page.api)
    page.select_option("#head-fusion", "max")
    _wait_overlay(page, previous=overlay["src"])
    assert [(m, q["model"], q["version"]) for m, p, q in page.api[start:] if p == "/explain"] == [
        ("GET", ["birds"], ["1"]), ("POST", ["birds"], ["1"])]
    assert page.is_hidden("#overlay-error") and page.is_hidden("#error")
    _screenshot(page, tmp_path, "page_models.png")

    assert len(page.errors) == 1 and "status of 404" in page.errors[0]  # Chromium logs the forgotten id's 404
    assert page.foreign == []


def test_the_page_asks_for_a_key_when_the_server_needs_one(tmp_path_factory, randomize, photo):
    """A gateway with API keys: the page shows the key form (its GET /models answered 401), and with the key
    entered it lists the model, classifies the photo as the API does with that key, and draws the overlay; every
    request after the key carries it as X-API-Key."""
    key = "page-key-5d1e"
    folder = tmp_path_factory.mktemp("page_keys")
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=32), seed=3)
    model.labels = list(LABELS)
    vit_serve.save(model, folder / "pets.safetensors")
    with live_server(settings_for(folder / "pets.safetensors", decode_workers=1, api_keys=[key])) as url, \
            _open_page(url) as pg:
        sent: list[str | None] = []
        pg.on("request", lambda r: sent.append(r.headers.get("x-api-key")) if "/classify" in r.url else None)
        pg.wait_for_selector("#key-form", state="visible")
        pg.fill("#api-key", key)
        pg.click("#key-form button")
        pg.wait_for_function("document.getElementById('model').textContent.includes('pets v1')")
        assert pg.is_hidden("#key-form")
        pg.set_input_files("#file", str(photo))
        pg.wait_for_function("document.querySelectorAll('#predictions li').length === 5")
        expected = httpx.post(f"{url}/classify", params={"top_k": 5}, headers={"X-API-Key": key},
                              files={"file": ("chelsea.jpg", photo.read_bytes(), "image/jpeg")}).json()
        assert [b["index"] for b in _bars(pg)] == [p["index"] for p in expected["predictions"]]
        _assert_drawn(pg, _wait_overlay(pg), (32, 32))
        assert sent and all(k == key for k in sent)
        assert not pg.errors or all("401" in e for e in pg.errors), pg.errors


def _smooth_images(n: int, seed: int) -> list[Image.Image]:
    """In-distribution images for a reference: two-colour linear gradients at random angles, 32 x 32."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32] / 31
    out = []
    for _ in range(n):
        a, b = rng.uniform(0, 255, (2, 3))
        t = np.cos(rng.uniform(0, np.pi)) * xx + np.sin(rng.uniform(0, np.pi)) * yy
        t = (t - t.min()) / (np.ptp(t) + 1e-9)
        out.append(Image.fromarray(np.clip(a + (b - a) * t[..., None], 0, 255).astype(np.uint8)))
    return out


@pytest.fixture(scope="module")
def onnx_server(tmp_path_factory, randomize) -> Iterator[str]:
    """A gateway serving an ONNX export (onnxruntime: rollout baked in at head fusion mean, discard ratio 0.9; no
    gradient rollout) of a 32x32 model whose reference was fitted on smooth gradients, so /classify answers an
    OOD score and flags uniform noise."""
    import vit_export

    from vit_serve.preprocess import PreprocessConfig, preprocess
    from vit_serve.reference import reference_from_datasets

    folder = tmp_path_factory.mktemp("page_onnx")
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=32), seed=3)
    model.labels = list(LABELS)
    model.preprocess_cfg = cfg = PreprocessConfig(input_size=(32, 32))
    fit = [(preprocess(im, cfg), 0) for im in _smooth_images(200, 10)]
    calibration = [(preprocess(im, cfg), 0) for im in _smooth_images(100, 11)]
    model.reference = reference_from_datasets(model, fit, calibration, "smooth gradients")
    vit_serve.save(model, folder / "pets.safetensors")
    result = vit_export.export(folder / "pets.safetensors", vit_export.ExportOptions(out=folder / "export",
                                                                                     name="pets"))
    assert result.ok
    with live_server(settings_for(result.onnx, decode_workers=1)) as url:
        yield url


def _png_file(folder: Path, name: str, pixels: np.ndarray) -> Path:
    path = folder / name
    Image.fromarray(pixels).save(path)
    return path


def test_an_onnx_export_s_refused_settings_are_disabled_and_the_ood_flag_shows(onnx_server, tmp_path):
    url = onnx_server
    version = httpx.get(f"{url}/models").json()["models"][0]["versions"][0]
    assert version["backend"] == "onnxruntime"
    assert version["explain_support"] == {"methods": ["rollout"], "head_fusion": "mean", "discard_ratio": 0.9}
    # What the page disables is what the API refuses.
    assert httpx.get(f"{url}/explain", params={"id": "0" * 64, "method": "grad_rollout"}).status_code == 400
    noise = _png_file(tmp_path, "noise.png", np.random.default_rng(5).integers(0, 256, (32, 32, 3), np.uint8))
    smooth = tmp_path / "smooth.png"
    _smooth_images(1, 99)[0].save(smooth)
    answers = {}
    for path in (noise, smooth):
        r = httpx.post(f"{url}/classify", params={"top_k": 5}, files={"file": (path.name, path.read_bytes(),
                                                                               "image/png")})
        assert r.status_code == 200, r.text
        answers[path.name] = r.json()["ood"]
    assert answers["noise.png"]["flag"] is True  # the API flags noise; the page must show it

    with _open_page(url) as page:
        page.wait_for_function("document.getElementById('model').textContent.includes('pets')")
        page.wait_for_selector("#explain-note:not([hidden])")
        disabled = page.eval_on_selector_all("#upload-form select", """selects => Object.fromEntries(selects.map(
            s => [s.id, [...s.options].filter(o => o.disabled).map(o => o.value)]))""")
        assert disabled == {"model-picker": [], "method": ["grad_rollout"], "head-fusion": ["max", "min"],
                            "discard-ratio": ["0", "0.5", "0.8", "0.95"]}
        note = page.inner_text("#explain-note")
        assert "head fusion mean and discard ratio 0.9 only" in note
        assert "gradient rollout needs the torch backend" in note and "onnxruntime" in note
        assert page.get_attribute("#method option[value=grad_rollout]", "title") == note

        for path in (noise, smooth):
            ood = answers[path.name]
            page.set_input_files("#file", str(path))
            page.wait_for_function("name => document.getElementById('status').textContent.startsWith(name)",
                                   arg=path.name)
            page.wait_for_selector("#ood:not([hidden])")
            text = page.inner_text("#ood")
            shown = re.search(r"OOD score (\S+) (>|≤) threshold (\S+?)[ ,)]", text)
            assert shown, text
            assert float(shown.group(1)) == pytest.approx(ood["score"], rel=5e-3)  # 3 significant digits
            assert float(shown.group(3)) == pytest.approx(ood["threshold"], rel=5e-3)
            assert text.startswith("Out of distribution" if ood["flag"] else "In distribution"), text
            assert ("flagged" in page.get_attribute("#ood", "class").split()) == ood["flag"]
            overlay = _wait_overlay(page)
            _assert_drawn(page, overlay, (32, 32))
            if ood["flag"]:
                _screenshot(page, tmp_path, "page_ood.png")
        assert page.is_hidden("#overlay-error") and page.is_hidden("#error")
        assert page.errors == [] and page.foreign == []
