"""Acceptance (issue 42): a real vector database client nobody here wrote, `qdrant-client` in local mode, indexes the
embeddings `vit-serve predict --task embed` wrote to Parquet for a folder of real photos (scikit-image's sample
pictures and matplotlib's grace_hopper.jpg), from a CLIP-family checkpoint (open_clip, random weights, converted by
`vit-serve convert`), and text queries embedded by `vit-serve predict --task embed-text` (the checkpoint's own text
tower) rank the photos exactly as brute-force cosine over the same vectors does. The rows carry the embedding
space's fingerprint, which the queries share, and the client refuses a query of another space as the docs say."""

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
pq = pytest.importorskip("pyarrow.parquet")
skdata = pytest.importorskip("skimage.data")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "export"))
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
    ckpt = folder / "clip.safetensors"
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
def index(written) -> tuple[object, list[dict], list[dict]]:
    """(a local qdrant client holding the photos' rows, the photos' rows, the queries' rows)."""
    from qdrant_client import QdrantClient, models

    images, texts = (pq.read_table(p).to_pylist() for p in written[:2])
    client = QdrantClient(":memory:")
    client.create_collection(COLLECTION, vectors_config=models.VectorParams(size=len(images[0]["embedding"]),
                                                                            distance=models.Distance.COSINE))
    client.upsert(COLLECTION, points=[models.PointStruct(id=i, vector=r["embedding"], payload={
        "path": r["path"], "embedding_fingerprint": r["embedding_fingerprint"]}) for i, r in enumerate(images)])
    return client, images, texts


def test_qdrant_ranks_predicts_photos_as_brute_force_cosine(index):
    client, images, texts = index
    assert len(images) == len(PHOTOS) + 1 and [r["text"] for r in texts] == QUERIES
    space = images[0]["embedding_fingerprint"]
    assert space and all(r["embedding_fingerprint"] == space for r in images + texts)
    vectors = np.array([r["embedding"] for r in images], np.float32)
    orders = set()
    for row in texts:
        query = np.asarray(row["embedding"], np.float32)
        hits = _search(client, row, len(images))
        want, cos = _ranking(vectors, query)
        print(f"{row['text']!r}: qdrant {[h.id for h in hits]}, brute force {want}")
        assert [h.id for h in hits] == want
        np.testing.assert_allclose([h.score for h in hits], cos, atol=1e-5)
        orders.add(tuple(want))
    assert len(orders) > 1  # the queries rank the photos differently: the ranking is the text's, not a constant


def test_the_rows_are_open_clips_vectors_and_a_query_of_another_space_finds_nothing(written, index, tmp_path):
    """The query rows are open_clip's `encode_text`, normalised (within 1e-4); a query embedded without
    --normalize has another fingerprint, and the search among points of its space finds none."""
    images_path, texts_path, model = written
    texts = pq.read_table(texts_path).to_pylist()
    with torch.no_grad():
        ref = torch.nn.functional.normalize(model.encode_text(open_clip.tokenize(QUERIES)), dim=-1).numpy()
    got = np.array([r["embedding"] for r in texts])
    print(f"text rows vs open_clip encode_text (normalised): max |Δ| = {np.abs(got - ref).max():.2e}")
    assert np.abs(got - ref).max() <= 1e-4
    import json

    ckpt = images_path.parent / "clip.safetensors"
    raw = tmp_path / "raw.jsonl"
    assert vit_serve_main(["predict", str(ckpt), str(images_path.parent / "queries.txt"), "--out", str(raw),
                           "--task", "embed-text", "--quiet"]) == 0
    other = json.loads(raw.read_text().splitlines()[0])
    assert other["embedding_fingerprint"] != texts[0]["embedding_fingerprint"]
    client, images, _ = index
    assert _search(client, other, len(images)) == [] and len(_search(client, texts[0], len(images))) == len(images)
