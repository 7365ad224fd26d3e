"""The web page at / in headless Chromium, against the real gateway (uvicorn in a thread, torch backend, a tiny
random ViT with labels): upload a real photo, read the bars and the overlay, and see the server's errors.

Chromium is the system one (`chromium` on PATH, e.g. Debian's package); no browser is ever downloaded. Set
VIT_SERVE_SCREENSHOT_DIR to keep the screenshot.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
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


@pytest.fixture
def page(server):
    """A fresh headless Chromium page on /; fails the test on any JS error or any request off the server."""
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1100, "height": 900})
            pg = context.new_page()
            pg.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            foreign: list[str] = []
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("request", lambda r: None if r.url.startswith((server, "blob:", "data:")) else foreign.append(r.url))
            pg.goto(server + "/")
            pg.errors, pg.foreign = errors, foreign
            yield pg
        finally:
            browser.close()


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


def test_upload_shows_the_top5_and_the_attention_overlay(server, page, photo, tmp_path):
    expected = httpx.post(f"{server}/classify", params={"top_k": 5},
                          files={"file": ("chelsea.jpg", photo.read_bytes(), "image/jpeg")}).json()
    assert [p["label"] for p in expected["predictions"]] != []  # the API answers before the page is judged

    assert page.get_attribute("#file", "accept") == "image/*"
    assert page.inner_text("label[for=file]").strip()  # the file input has a visible label
    page.wait_for_function("document.getElementById('model').textContent.includes('pets')")
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
    assert expected["model"] in page.inner_text("#meta")

    overlay = _wait_overlay(page)
    assert (overlay["w"], overlay["h"]) == (32, 32)  # the map over the model-input crop
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
    assert (changed["w"], changed["h"]) == (32, 32)
    assert "head fusion max" in page.inner_text("#overlay-caption")
    # Gradient rollout (the torch backend has it).
    page.select_option("#method", "grad_rollout")
    grad = _wait_overlay(page, previous=changed["src"])
    assert (grad["w"], grad["h"]) == (32, 32)
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
