"""`vit-serve predict --engine ray` on a local Ray cluster this module starts (`ray.init(num_cpus=2)`): the same rows
as the local engine (reference: the local engine's output, itself checked against `/classify` and the library in
test_predict.py), the same unreadable files reported, and a rerun that skips what is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_predict import LABELS, RES, by_path, read_rows, run

import vit_serve
from vit_serve.preprocess import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PreprocessConfig

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data", reason="Ray Data (pip install 'vit-serve[ray]') is not importable")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, randomize) -> Path:
    model = randomize(vit_serve.create_model("Ti/16", depth=2, num_classes=10, img_size=RES), seed=4)
    model.labels = list(LABELS)
    model.preprocess_cfg = PreprocessConfig(input_size=RES, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """A handful of scikit-image photos and one truncated JPEG."""
    data = pytest.importorskip("skimage.data")
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    for name in ("astronaut", "coffee", "chelsea", "rocket", "camera"):
        Image.fromarray(getattr(data, name)()).convert("RGB").resize((96, 72)).save(root / f"{name}.jpg")
    good = (root / "coffee.jpg").read_bytes()
    (root / "broken.jpg").write_bytes(good[: len(good) // 3])
    return root


def test_ray_engine_gives_the_local_engines_rows(cluster, ckpt, images, tmp_path):
    torch.set_num_threads(1)
    args = ("--embeddings", "--explain", "--batch-size", "2", "--threads", "1")
    assert run(ckpt, images, "--out", tmp_path / "local.parquet", *args) == 0
    assert run(ckpt, images, "--out", tmp_path / "ray.parquet", "--engine", "ray", *args) == 0
    local, distributed = by_path(read_rows(tmp_path / "local.parquet")), by_path(read_rows(tmp_path / "ray.parquet"))
    assert set(distributed) == set(local) == {str(p) for p in images.glob("*.jpg") if p.name != "broken.jpg"}
    local_maps = np.load(tmp_path / "local.parquet.rollout.npy")
    ray_maps = np.load(tmp_path / "ray.parquet.rollout.npy")
    for path, want in local.items():
        got = distributed[path]
        assert got["labels"] == want["labels"] and got["indices"] == want["indices"]
        np.testing.assert_allclose(got["scores"], want["scores"], atol=1e-6)  # batches may be formed differently
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=1e-5)
        np.testing.assert_allclose(ray_maps[got["rollout_index"]], local_maps[want["rollout_index"]], atol=1e-6)
    errors = [json.loads(line)["path"] for line in (tmp_path / "ray.parquet.errors.jsonl").read_text().splitlines()]
    assert errors == [str(images / "broken.jpg")]
    manifest = json.loads((tmp_path / "ray.parquet.manifest.json").read_text())
    assert manifest["engine"] == "ray"


def test_ray_engine_resumes_and_writes_jsonl_too(cluster, ckpt, images, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert run(ckpt, images, "--out", out, "--engine", "ray", "--threads", "1") == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]))
    capsys.readouterr()
    assert run(ckpt, images, "--out", out, "--engine", "ray", "--threads", "1") == 0
    assert "3 rows written, 2 already there" in capsys.readouterr().out
    assert len(by_path(read_rows(out))) == 5
