"""Fixtures of the gateway tests: a tiny random ViT with labels (non-square, 32x48, so that a transposed grid
shows), its ONNX export (via `vit-export`), and real photos. Helpers are in gateway_helpers.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from gateway_helpers import LABELS, RES
from PIL import Image

import vit_serve


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, save_tiny) -> Path:
    """A 2-block Ti/16 at 32x48 (grid 2x3), random non-trivial weights, 10 labels, an ImageNet-style contract."""
    return save_tiny(tmp_path_factory.mktemp("ckpt") / "tiny.safetensors", RES, 1, LABELS)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    """The reference: the checkpoint loaded by the library, in eval mode."""
    return vit_serve.load(tiny_ckpt).eval()


@pytest.fixture(scope="session")
def tiny_onnx(tiny_ckpt, tmp_path_factory) -> Path:
    """tiny.onnx + tiny.json and tiny_explain.onnx + tiny_explain.json, written by `vit_export.export`."""
    import vit_export

    result = vit_export.export(tiny_ckpt, vit_export.ExportOptions(out=tmp_path_factory.mktemp("export"), name="tiny"))
    assert result.ok
    return result.onnx


@pytest.fixture(scope="module")
def backend(tiny_onnx):
    """The tiny export on onnxruntime (one thread): the reference the /v2 and gRPC tests compare with."""
    from vit_serve.runtime.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(tiny_onnx, device="cpu", threads=1)


@pytest.fixture(scope="module")
def pixels(photos, backend) -> np.ndarray:
    """The photos preprocessed with the export's contract, [3, 3, H, W] float32."""
    from vit_serve.preprocess import preprocess

    return torch.stack([preprocess(b, backend.info.preprocess) for b in photos.values()]).numpy()


def _encode(arr: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Real photos (scikit-image's sample pictures) as encoded bytes: astronaut PNG, coffee and chelsea JPEG."""
    data = pytest.importorskip("skimage.data")
    return {"astronaut.png": _encode(data.astronaut(), "PNG"), "coffee.jpg": _encode(data.coffee(), "JPEG"),
            "chelsea.jpg": _encode(data.chelsea(), "JPEG")}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def phone_jpeg() -> bytes:
    """A 12 MP (4032x3024) JPEG as a good phone camera writes it: scikit-image's astronaut resized, with
    sensor-like grain, quality 95 (about 5 MiB: over gRPC's own 4 MiB default, kserve#3717)."""
    data = pytest.importorskip("skimage.data")
    img = Image.fromarray(data.astronaut()).resize((4032, 3024), Image.Resampling.BICUBIC)
    a = np.asarray(img, np.float32) + np.random.default_rng(1).normal(0.0, 8.0, (3024, 4032, 3)).astype(np.float32)
    buf = io.BytesIO()
    Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=95)
    return buf.getvalue()
