"""Shared fixtures of the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest

import vit_serve


@pytest.fixture(scope="session")
def tiny_onnx_32(tmp_path_factory) -> Path:
    """tiny.onnx (+ its manifest): a 2-block Ti/16 at 32x32, 10 classes, random weights, exported by vit-export."""
    import vit_export

    folder = tmp_path_factory.mktemp("tiny_onnx")
    ckpt = folder / "tiny.safetensors"
    vit_serve.save(vit_serve.create_model("Ti/16", num_classes=10, img_size=32, depth=2), ckpt)
    vit_export.export(ckpt, vit_export.ExportOptions(res=32, out=folder, name="tiny"))
    return folder / "tiny.onnx"
