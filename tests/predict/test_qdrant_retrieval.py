"""Acceptance (issue 42): a real vector database client nobody here wrote, `qdrant-client` in local mode, indexes the
embeddings `vit-serve predict --task embed` wrote to Parquet for a folder of real photos (scikit-image's sample
pictures and matplotlib's grace_hopper.jpg), from a CLIP-family checkpoint (open_clip, random weights, converted by
`vit-serve convert`), and text queries embedded through the gateway's `POST /v1/embeddings` (the official `openai`
SDK; the checkpoint's own text tower) rank the photos exactly as brute-force cosine over the same vectors does.
The rows carry the embedding space's fingerprint, which /v1's answer shares; `vit-serve predict --task embed-text`
writes the same query vectors offline (and open_clip's `encode_text`), and a query of another space finds nothing
among the points of the index's, as the docs say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vit_serve.cli import main as vit_serve_main

qdrant = pytest.importorskip("qdrant_client")
open_clip = pytest.importorskip("open_clip")
openai = pytest.importorskip("openai")
pq = pytest.importorskip("pyarrow.parquet")
skdata = pytest.importorskip("skimage.data")
TESTS = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(TESTS / "export"), str(TESTS / "serve")]
from gateway_helpers import live_app, settings_for  # noqa: E402
from test_text_tower import ARCH, tiny_clip  # noqa: E402

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "cat", "immunohistochemistry")
QUERIES = ["an astronaut in a space suit", "a cup of coffee", "a cat", "a rocket on the launch pad",
           "a portrait of a naval officer"]
COLLECTION = "photos"


@pytest.fixture(scope="module")
def written(tmp_path_factory, randomize) -> tuple[Path, Path, torch.nn.Module]:
    """(the images' Parquet, the queries' Parquet, the open_clip model): both written by `vit-serve predict`."""
    from matplotlib import cbook

    folder = tmp_path_factory.mktemp("qdrant")
    photos = folder / "photos"
    photos.mkdir()
    for name in PHOTOS:
        Image.fromarray(getattr(skdata, name)()).convert("RGB").save(photos / f"{name}.jpg", quality=92)
    with cbook.get_sample_data("grace_hopper.jpg") as f:
        (photos / "grace_hopper.jpg").write_bytes(f.read())
    model = tiny_clip(randomize, seed=11)
    torch.save(model.state_dict(), folder / "oc.pt")
    (folder / "repo").mkdir()
    ckpt = folder / "repo" / "clip.safetensors"
    assert vit_serve_main(["convert", str(folder / "oc.pt"), str(ckpt), "--arch", ARCH]) == 0
    (folder / "queries.txt").write_text("\n".join(QUERIES) + "\n")
    images, texts = folder / "images.parquet", folder / "queries.parquet"
    assert vit_serve_main(["predict", str(ckpt), str(photos), "--out", str(images), "--task", "embed",
                           "--normalize", "--quiet"]) == 0
    assert vit_serve_main(["predict", str(ckpt), str(folder / "queries.txt"), "--out", str(texts),
                           "--task", "embed-text", "--normalize", "--quiet"]) == 0
    return images, texts, model


def _ranking(index: np.ndarray, query: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Brute-force cosine: the rows of `index` best first, and their cosines."""
    a = index / np.linalg.norm(index, axis=1, keepdims=True)
    cos = a @ (query / np.linalg.norm(query))
    order = np.argsort(-cos, kind="stable")
    return order.tolist(), cos[order]


def _search(client, row: dict, limit: int) -> list:
    """The docs' recipe: search only among points of the query's space (the fingerprint stored with each)."""
    from qdrant_client import models

    same_space = models.Filter(must=[models.FieldCondition(
        key="embedding_fingerprint", match=models.MatchValue(value=row["embedding_fingerprint"]))])
    return client.query_points(COLLECTION, query=row["embedding"], limit=limit, query_filter=same_space).points


@pytest.fixture(scope="module")
def index(written) -> tuple[object, list[dict]]:
    """(a local qdrant client holding the photos' rows, the photos' rows)."""
    from qdrant_client import QdrantClient, models

    images = pq.read_table(written[0]).to_pylist()
    client = QdrantClient(":memory:")
    client.create_collection(COLLECTION, vectors_config=models.VectorParams(size=len(images[0]["embedding"]),
                                                                            distance=models.Distance.COSINE))
    client.upsert(COLLECTION, points=[models.PointStruct(id=i, vector=r["embedding"], payload={
        "path": r["path"], "embedding_fingerprint": r["embedding_fingerprint"]}) for i, r in enumerate(images)])
    return client, images


@pytest.fixture(scope="module")
def queries(written) -> list[dict]:
    """The queries through the gateway's POST /v1/embeddings (the openai SDK, its default base64), serving the
    checkpoint predict read: rows of {text, embedding, embedding_fingerprint}."""
    with live_app(settings_for(written[0].parent / "repo", default_model="clip")) as (url, _):
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = sdk.embeddings.create(model="clip", input=QUERIES)
    space = answer.model_extra["embedding_fingerprint"]
    return [{"text": q, "embedding": d.embedding, "embedding_fingerprint": space}
            for q, d in zip(QUERIES, answer.data, strict=True)]


def test_qdrant_ranks_predicts_photos_as_brute_force_cosine(index, queries):
    client, images = index
    assert len(images) == len(PHOTOS) + 1
    space = images[0]["embedding_fingerprint"]
    assert space and all(r["embedding_fingerprint"] == space for r in images + queries)
    vectors = np.array([r["embedding"] for r in images], np.float32)
    orders = set()
    for row in queries:
        query = np.asarray(row["embedding"], np.float32)
        hits = _search(client, row, len(images))
        want, cos = _ranking(vectors, query)
        print(f"{row['text']!r}: qdrant {[h.id for h in hits]}, brute force {want}")
        assert [h.id for h in hits] == want
        np.testing.assert_allclose([h.score for h in hits], cos, atol=1e-5)
        orders.add(tuple(want))
    assert len(orders) > 1  # the queries rank the photos differently: the ranking is the text's, not a constant


def test_predicts_queries_are_v1s_and_open_clips_and_another_space_finds_nothing(written, index, queries, tmp_path):
    """predict --task embed-text's rows are /v1/embeddings' vectors with its fingerprint, and open_clip's
    `encode_text`, normalised (within 1e-4); a query embedded without --normalize has another fingerprint, and the
    search among points of its space finds none."""
    images_path, texts_path, model = written
    texts = pq.read_table(texts_path).to_pylist()
    assert [r["text"] for r in texts] == QUERIES
    assert [r["embedding_fingerprint"] for r in texts] == [q["embedding_fingerprint"] for q in queries]
    np.testing.assert_allclose([r["embedding"] for r in texts], [q["embedding"] for q in queries], atol=1e-5)
    with torch.no_grad():
        ref = torch.nn.functional.normalize(model.encode_text(open_clip.tokenize(QUERIES)), dim=-1).numpy()
    got = np.array([r["embedding"] for r in texts])
    print(f"text rows vs open_clip encode_text (normalised): max |Δ| = {np.abs(got - ref).max():.2e}")
    assert np.abs(got - ref).max() <= 1e-4
    import json

    ckpt = images_path.parent / "repo" / "clip.safetensors"
    raw = tmp_path / "raw.jsonl"
    assert vit_serve_main(["predict", str(ckpt), str(images_path.parent / "queries.txt"), "--out", str(raw),
                           "--task", "embed-text", "--quiet"]) == 0
    other = json.loads(raw.read_text().splitlines()[0])
    assert other["embedding_fingerprint"] != texts[0]["embedding_fingerprint"]
    client, images = index
    assert _search(client, other, len(images)) == [] and len(_search(client, texts[0], len(images))) == len(images)
