"""NaFlex over HTTP (issue 41): `POST /embed?max_patches=N` of a SigLIP 2 NaFlex model served by a real gateway.

Reference: transformers 5.25's own `Siglip2ImageProcessor(max_num_patches=N)` and `Siglip2VisionModel` (tiny, random
weights, built here; nothing downloaded), saved as a Hugging Face folder and served as it is. Photos: scikit-image's
astronaut, coffee and chelsea cut to a portrait, a wide and a square image, sent as PNG (lossless: both sides read
the same pixels, so the same patches: 1e-4) and as JPEG (end to end against the photo's own pixels: cosine >= 0.999;
against the processor given the same file as PIL opens it: 1e-4). An image's embedding is the same alone and in a
burst of concurrent requests of other shapes and budgets that really batch (transformers #23218 is the bug where it
is not). POST /explain?max_patches= is the rollout of transformers' own attention probabilities over the real
patches, at the image's own grid. Bounds and refusals in one line.
"""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import live_app, settings_for
from naflex_models import aspect_photos, siglip2_tower
from PIL import Image

transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")

BUDGETS = (256, 64)
PNG, JPEG = {"Content-Type": "image/png"}, {"Content-Type": "image/jpeg"}


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    """uint8 RGB [H, W, 3]: portrait 512x300, wide 400x600, square 300x300."""
    return aspect_photos()


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory):
    """(the HF model, its saved folder): a 2-layer SigLIP 2 tower, width 64, a 16 x 16 stored position grid, every
    weight perturbed (nothing trivially zero)."""
    folder = tmp_path_factory.mktemp("siglip2_http")
    ref = siglip2_tower(folder, seed=41, num_patches=256)
    return ref, folder


def _hf_embedding(ref, image: np.ndarray | Image.Image, n: int) -> np.ndarray:
    x = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=[image], return_tensors="pt")
    with torch.no_grad():
        return ref(**x).pooler_output[0].numpy()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embed_equals_hf_processor_and_model(siglip2, photos):
    ref, folder = siglip2
    with live_app(settings_for(folder, max_batch=1)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for n in BUDGETS:
            for name, pixels in photos.items():
                r = client.post(f"/embed?max_patches={n}", content=_encode(pixels, "PNG"), headers=PNG)
                assert r.status_code == 200, r.text
                got, want = np.array(r.json()["embedding"]), _hf_embedding(ref, pixels, n)
                assert np.abs(got - want).max() <= 1e-4, (name, n, np.abs(got - want).max())

                jpeg = _encode(pixels, "JPEG")
                r = client.post(f"/embed?max_patches={n}", content=jpeg, headers=JPEG)
                assert r.status_code == 200, r.text
                got = np.array(r.json()["embedding"])
                # end to end: the photo's embedding through a JPEG encode and decode
                assert _cosine(got, _hf_embedding(ref, pixels, n)) >= 0.999, (name, n)
                # the same file as PIL opens it for the processor: the same pixels again
                want = _hf_embedding(ref, Image.open(io.BytesIO(jpeg)), n)
                assert np.abs(got - want).max() <= 1e-4, (name, n, np.abs(got - want).max())


def test_default_budget_is_the_models(siglip2, photos):
    ref, folder = siglip2
    png = _encode(photos["wide"], "PNG")
    with live_app(settings_for(folder, max_batch=1)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        plain = client.post("/embed", content=png, headers=PNG)
        classified = client.post("/classify?max_patches=64", content=png, headers=PNG)
        models = client.get("/models").json()
    assert plain.status_code == 200 and classified.status_code == 200, (plain.text, classified.text)
    want = _hf_embedding(ref, photos["wide"], 256)  # no preprocessor config saved: the processor's default
    assert np.abs(np.array(plain.json()["embedding"]) - want).max() <= 1e-4
    assert models  # the model is listed


def test_alone_equals_in_a_burst_of_other_shapes_and_budgets(siglip2, photos):
    _, folder = siglip2
    uploads = [(name, n, _encode(pixels, "PNG")) for name, pixels in photos.items() for n in BUDGETS]

    async def embed(client: httpx.AsyncClient, n: int, body: bytes) -> dict:
        r = await client.post(f"/embed?max_patches={n}", content=body, headers=PNG)
        assert r.status_code == 200, r.text
        return r.json()

    async def scenario(url: str) -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            alone = [await embed(client, n, body) for _, n, body in uploads]
            burst = await asyncio.gather(*(embed(client, n, body) for _, n, body in uploads * 2))
        return alone, burst

    with live_app(settings_for(folder, max_batch=16, max_delay_ms=1000)) as (url, _):
        alone, burst = asyncio.run(scenario(url))
    assert all(a["timing_ms"]["batch_size"] == 1 for a in alone)
    # the burst really batched: 3 rows of one budget hold at least 2 shapes (each shape is sent twice per budget)
    assert max(b["timing_ms"]["batch_size"] for b in burst) >= 3
    for i, (name, n, _) in enumerate(uploads * 2):
        a, b = np.array(alone[i % len(uploads)]["embedding"]), np.array(burst[i]["embedding"])
        assert np.abs(a - b).max() <= 1e-5, (name, n, np.abs(a - b).max())


def test_bounds_and_refusals(siglip2, photos, save_tiny, tmp_path):
    _, folder = siglip2
    png = _encode(photos["square"], "PNG")
    with live_app(settings_for(folder, max_batch=1)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        over = client.post("/embed?max_patches=257", content=png, headers=PNG)
        zero = client.post("/classify?max_patches=0", content=png, headers=PNG)
        kept = client.post("/embed", content=png, headers=PNG).json()["id"]
        by_id = client.get(f"/explain?id={kept}")
        by_gradient = client.post("/explain?method=grad_rollout", content=png, headers=PNG)
    for r in (over, zero):
        assert r.status_code == 422 and "from 1 to 256 (the model's patch budget)" in r.text, r.text
    assert by_id.status_code == 400 and "NaFlex model: its images are not kept" in by_id.text, by_id.text
    assert by_gradient.status_code == 400 and "explained by method=rollout only" in by_gradient.text, by_gradient.text

    fixed = save_tiny(tmp_path / "tiny.safetensors", (32, 32), 3, ["a", "b", "c"])
    with live_app(settings_for(fixed)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        refused = client.post("/embed?max_patches=64", content=png, headers=PNG)
        plain = client.post("/embed", content=png, headers=PNG)
    assert refused.status_code == 400 and "is not a NaFlex model" in refused.text, refused.text
    assert plain.status_code == 200


def _hf_rollout(ref, pixels: np.ndarray, n: int, head_fusion: str, discard_ratio: float) -> np.ndarray:
    """The reference map: attention rollout (`vit_serve.explain.rollout`) of transformers' own attention
    probabilities on its own processor's patches, cut to the real ones (padded keys carry no probability), the
    MAP head's probe attention from its nn.MultiheadAttention; [h, w] at the processor's spatial_shapes."""
    from vit_serve.explain import rollout

    x = transformers.Siglip2ImageProcessor(max_num_patches=n)(images=[pixels], return_tensors="pt")
    h, w = x["spatial_shapes"][0].tolist()
    with torch.no_grad():
        out = ref(**x, output_attentions=True)
        hidden = out.last_hidden_state[:, :h * w]
        head = ref.head
        _, probe = head.attention(head.probe, hidden, hidden, need_weights=True, average_attn_weights=False)
    attentions = [a[:, :, :h * w, :h * w] for a in out.attentions] + [probe]
    return rollout(attentions, (h, w), 0, "map", head_fusion, discard_ratio).map[0].numpy()


def test_explain_is_the_rollout_over_real_patches_at_the_images_grid(siglip2, photos):
    ref, folder = siglip2
    ref.set_attn_implementation("eager")  # probabilities out of every layer
    with live_app(settings_for(folder, max_batch=1)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        for n in BUDGETS:
            for name, pixels in photos.items():
                png = _encode(pixels, "PNG")
                r = client.post(f"/explain?max_patches={n}&format=json", content=png, headers=PNG)
                assert r.status_code == 200, r.text
                got = r.json()
                want = _hf_rollout(ref, pixels, n, got["head_fusion"], got["discard_ratio"])
                assert got["grid"] == list(want.shape) and got["query"] == "map-probe", (name, n, got["grid"])
                assert np.abs(np.array(got["map"]) - want).max() <= 1e-5, (name, n)
                picture = client.post(f"/explain?max_patches={n}", content=png, headers=PNG)
                assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
                assert Image.open(io.BytesIO(picture.content)).size == pixels.shape[1::-1]  # over the whole image


def test_v2_infer_takes_max_patches_on_encoded_images(siglip2, photos):
    """/v2 infer with `parameters.max_patches`: the images of one request (three shapes) at that budget, each row
    the processor's and model's embedding; refusals in one line."""
    httpclient = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    ref, folder = siglip2
    images = np.array([_encode(p, "PNG") for p in photos.values()], dtype=np.object_)
    inp = httpclient.InferInput("image", [len(images)], "BYTES")
    inp.set_data_from_numpy(images, binary_data=True)
    embedding = [httpclient.InferRequestedOutput("embedding", binary_data=True)]
    with live_app(settings_for(folder, max_batch=4)) as (url, _):
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        name = client.get_model_repository_index()[0]["name"]
        got = client.infer(name, [inp], outputs=embedding, parameters={"max_patches": 64}).as_numpy("embedding")
        with pytest.raises(InferenceServerException, match="from 1 to 256"):
            client.infer(name, [inp], outputs=embedding, parameters={"max_patches": 1000})
        with pytest.raises(InferenceServerException, match="served by POST /explain"):
            client.infer(name, [inp], outputs=[httpclient.InferRequestedOutput("rollout")],
                         parameters={"max_patches": 64})
    for row, pixels in zip(got, photos.values(), strict=True):
        assert np.abs(row - _hf_embedding(ref, pixels, 64)).max() <= 1e-4


def test_onnxruntime_serves_the_naflex_graph(siglip2, photos, tmp_path):
    """An export with `vit-export --naflex` served on onnxruntime: `?max_patches=` runs NAME_naflex.onnx, with the
    same embeddings as transformers; its rollout is the torch backend's (one line)."""
    import vit_export

    from vit_serve.checkpoints import convert

    ref, folder = siglip2
    convert(folder, tmp_path / "s2.safetensors")
    result = vit_export.export(tmp_path / "s2.safetensors",
                               vit_export.ExportOptions(out=tmp_path / "export", name="s2", naflex=True))
    assert result.ok and (tmp_path / "export" / "s2_naflex.onnx").is_file()
    with live_app(settings_for(result.onnx, max_batch=1)) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as client:
        for n in BUDGETS:
            for name, pixels in photos.items():
                r = client.post(f"/embed?max_patches={n}", content=_encode(pixels, "PNG"), headers=PNG)
                assert r.status_code == 200, r.text
                got = np.array(r.json()["embedding"])
                assert np.abs(got - _hf_embedding(ref, pixels, n)).max() <= 1e-4, (name, n)
        explain = client.post("/explain?max_patches=64", content=_encode(photos["wide"], "PNG"), headers=PNG)
        models = client.get("/models").text
    assert explain.status_code == 400 and "need the torch backend" in explain.text, explain.text
    assert "onnxruntime" in models
