"""Weaviate's multi2vec inference contract (/weaviate/ and /weaviate/{model}/), checked against what Weaviate's own
module does (weaviate/weaviate modules/multi2vec-clip/clients: POST /vectorize with `{"texts", "images"}`, an empty
list marshalled as null, `{"textVectors", "imageVectors"}` back, `{"error"}` on a status > 399; GET /meta a JSON
object; GET /.well-known/ready <= 299 at startup), on a tiny open_clip CLIP with random weights converted with
`vit-serve convert` and exported with `vit-export --text-tower`: the texts' vectors equal open_clip's
`encode_text` normalised, the images' equal POST /embed?normalize=true and both equal POST /v1/embeddings' for the
same inputs (one code path); keys apply unless `open_weaviate` opens
/weaviate/ alone, with a warning logged."""

from __future__ import annotations

import asyncio
import base64
import logging
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gateway_helpers import run, serving, settings_for

import vit_serve

open_clip = pytest.importorskip("open_clip")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "export"))
from test_text_tower import ARCH, tiny_clip  # noqa: E402

KEY = "weaviate-test-key-51d0"
TEXTS = ["a photo of a cat", "an origami crane on a desk", "lighthouse at night"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, randomize) -> tuple[Path, object]:
    """(REPO, the open_clip model): clip (the CLIP converted and exported with its text tower) and plain (an
    image-only ViT)."""
    import vit_export

    from vit_serve.cli import main as serve_main

    folder = tmp_path_factory.mktemp("weaviate")
    model = tiny_clip(randomize, seed=7)
    torch.save(model.state_dict(), folder / "oc.pt")
    repo = folder / "repo"
    assert serve_main(["convert", str(folder / "oc.pt"), str(folder / "clip.safetensors"), "--arch", ARCH]) == 0
    result = vit_export.export(folder / "clip.safetensors", vit_export.ExportOptions(
        out=repo, name="clip", text_tower=True, formats=("onnx",)))
    assert result.ok and result.text is not None
    vit_serve.save(randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=3, img_size=32)),
                   repo / "plain.safetensors")
    return repo, model


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _encode_text(model, texts: list[str]) -> np.ndarray:
    with torch.no_grad():
        return torch.nn.functional.normalize(model.encode_text(open_clip.tokenize(texts)), dim=-1).numpy()


async def _embed(client: httpx.AsyncClient, name: str, photo: bytes) -> np.ndarray:
    """POST /embed?normalize=true of one photo."""
    r = await client.post("/embed", params={"normalize": "true"}, content=photo,
                          headers={"Content-Type": "image/png" if name.endswith(".png") else "image/jpeg"})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embedding"], np.float32)


async def _wait_for_startup(client: httpx.AsyncClient, prefix: str, timeout_s: float = 60.0) -> None:
    """As the module's WaitForStartup: GET /.well-known/ready until its status is <= 299; a 503 until then."""
    deadline = time.monotonic() + timeout_s
    while (r := await client.get(f"{prefix}/.well-known/ready")).status_code > 299:
        assert r.status_code == 503 and "not ready" in r.json()["error"], r.text
        assert time.monotonic() < deadline, f"{prefix} not ready in {timeout_s} s"
        await asyncio.sleep(0.1)


def test_probes_meta_and_vectorize_as_weaviates_module_calls_them(repo, photos):
    folder, model = repo
    jpeg, png = photos["chelsea.jpg"], photos["astronaut.png"]

    async def go() -> None:
        async with serving(settings_for(folder, default_model="clip")) as (client, _):
            await _wait_for_startup(client, "/weaviate/plain")  # its warm-up may still run: 503 until then
            for prefix in ("/weaviate", "/weaviate/clip", "/weaviate/plain"):
                for probe in ("live", "ready"):
                    r = await client.get(f"{prefix}/.well-known/{probe}")
                    assert r.status_code == 204 and r.content == b"", (prefix, probe, r.text)
            missing = await client.get("/weaviate/nosuch/.well-known/ready")
            assert missing.status_code == 404 and "nosuch" in missing.json()["error"]

            meta = await client.get("/weaviate/meta")
            assert meta.status_code == 200 and isinstance(meta.json(), dict)
            space = meta.json()["embedding_fingerprint"]
            assert space and space == (await client.post("/embed?normalize=true", content=png, headers={
                "Content-Type": "image/png"})).json()["embedding_fingerprint"]
            assert meta.json()["model"] == "clip" and meta.json()["text_tower"]["embedding_dim"] == 32
            assert (await client.get("/weaviate/plain/meta")).json()["model"] == "plain"

            by_embed = {name: await _embed(client, name, photos[name]) for name in ("chelsea.jpg", "astronaut.png")}
            for texts, images in ((TEXTS[:1], []), (TEXTS, []), ([], [jpeg]), ([], [jpeg, png]),
                                  (TEXTS, [png, jpeg])):
                body = {"texts": texts or None, "images": [_b64(i) for i in images] or None}  # Go's nil: null
                for prefix in ("/weaviate", "/weaviate/clip"):
                    r = await client.post(f"{prefix}/vectorize", json=body)
                    assert r.status_code == 200, r.text
                    out = r.json()
                    tv, iv = np.asarray(out["textVectors"]), np.asarray(out["imageVectors"])
                    assert len(tv) == len(texts) and len(iv) == len(images)
                    assert out["embedding_fingerprint"] == space
                    if texts:
                        ref = _encode_text(model, texts)
                        print(f"{len(texts)} texts vs open_clip's encode_text: {np.abs(tv - ref).max():.2e}")
                        np.testing.assert_allclose(tv, ref, atol=1e-4, rtol=0)
                    for got, sent in zip(iv, images, strict=True):
                        want = by_embed["chelsea.jpg" if sent is jpeg else "astronaut.png"]
                        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
                        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-5)
            # the vectors of POST /v1/embeddings for the same inputs (one code path), in one request
            mixed = {"texts": TEXTS, "images": [_b64(png), _b64(jpeg)]}
            weaviate = (await client.post("/weaviate/vectorize", json=mixed)).json()
            inputs = [*TEXTS, f"data:image/png;base64,{_b64(png)}", f"data:image/jpeg;base64,{_b64(jpeg)}"]
            v1 = await client.post("/v1/embeddings", json={"model": "clip", "input": inputs,
                                                            "encoding_format": "float"})
            assert v1.status_code == 200, v1.text
            openai = np.asarray([d["embedding"] for d in v1.json()["data"]])
            np.testing.assert_array_equal(np.asarray(weaviate["textVectors"] + weaviate["imageVectors"]), openai)
            empty = await client.post("/weaviate/vectorize", json={})
            assert empty.status_code == 200
            assert empty.json() == {"textVectors": [], "imageVectors": [], "embedding_fingerprint": None}

    run(go())


def test_refusals_answer_the_error_field_weaviate_reads(repo, photos):
    folder, _ = repo

    async def go() -> None:
        async with serving(settings_for(folder, default_model="clip", max_images_per_request=4)) as (client, _):
            cases = [
                ("/weaviate/vectorize", {"images": ["not base64!"]}, 400, "images[0] is not base64"),
                ("/weaviate/vectorize", {"texts": [" ".join(["word"] * 90)]}, 400, "context length"),
                ("/weaviate/vectorize", {"texts": TEXTS, "images": [_b64(photos["coffee.jpg"])] * 2}, 400,
                 "over the limit of 4"),
                ("/weaviate/plain/vectorize", {"texts": ["a cat"]}, 400, "has no text tower"),
                ("/weaviate/vectorize", {"images": [_b64(b"not an image at all")]}, 415, ""),
                ("/weaviate/nosuch/vectorize", {"texts": ["a cat"]}, 404, "nosuch"),
            ]
            for path, body, status, words in cases:
                r = await client.post(path, json=body)
                assert r.status_code == status, (path, body, r.text)
                assert set(r.json()) == {"error"} and words in r.json()["error"], r.text
            plain = await client.post("/weaviate/plain/vectorize", json={"images": [_b64(photos["coffee.jpg"])]})
            assert plain.status_code == 200 and len(plain.json()["imageVectors"][0]) == 192

    run(go())


def test_keys_apply_unless_open_weaviate_opens_these_routes_alone(repo, photos, caplog):
    folder, _ = repo
    body = {"texts": ["a cat"], "images": [_b64(photos["coffee.jpg"])]}

    async def go(open_weaviate: bool) -> None:
        settings = settings_for(folder, default_model="clip", api_keys=[KEY], open_weaviate=open_weaviate)
        async with serving(settings) as (client, _):
            for probe in ("/weaviate/.well-known/ready", "/weaviate/clip/.well-known/live"):
                assert (await client.get(probe)).status_code == 204  # open, as /readyz
            unknown = await client.get("/weaviate/nosuch/.well-known/ready")  # open: no model list to anyone
            assert unknown.status_code == 503 and "clip" not in unknown.text and "plain" not in unknown.text
            refused = (await client.post("/weaviate/vectorize", json=body),
                       await client.get("/weaviate/clip/meta"))
            with_key = await client.post("/weaviate/clip/vectorize", json=body, headers={"X-API-Key": KEY})
            assert with_key.status_code == 200, with_key.text
            wrong = await client.post("/weaviate/vectorize", json=body, headers={"X-API-Key": "not-" + KEY})
            assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]  # a key sent is checked
            for r in refused:
                if open_weaviate:
                    assert r.status_code == 200, r.text
                else:
                    assert r.status_code == 401 and "API key" in r.json()["error"], r.text
            if open_weaviate:
                assert refused[0].json() == with_key.json()
            embed = await client.post("/embed", content=photos["coffee.jpg"],
                                      headers={"Content-Type": "image/jpeg"})
            assert embed.status_code == 401  # the rest of the API keeps its keys

    with caplog.at_level(logging.WARNING, logger="vit_serve.serve"):
        run(go(False))
        assert not [r for r in caplog.records if "open-weaviate" in r.getMessage()]
        run(go(True))
    warned = [r for r in caplog.records if "open-weaviate" in r.getMessage()]
    assert len(warned) == 1 and "without an API key" in warned[0].getMessage()
