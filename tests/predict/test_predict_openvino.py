"""`vit-serve predict --backend openvino`: the export's rows on OpenVINO at f32 equal onnxruntime's, the manifest
names the backend, and a checkpoint is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_serve.cli import main

pytest.importorskip("openvino")
LABELS = [f"class_{i}" for i in range(10)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny) -> tuple[Path, Path]:
    """(checkpoint, its export): a 2-block Ti/16 at 32x48, random non-trivial weights."""
    folder = tmp_path_factory.mktemp("export")
    result, ckpt = export_tiny(folder, (32, 48), 7, LABELS, contract=True, out=folder, name="tiny")
    assert result.ok
    return ckpt, result.onnx


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    data = pytest.importorskip("skimage.data")
    root = tmp_path_factory.mktemp("photos")
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        Image.fromarray(getattr(data, name)()).resize((120, 90)).save(root / f"{name}.jpg", quality=90)
    return root


def _rows(out: Path) -> dict[str, dict]:
    return {r["path"]: r for r in (json.loads(line) for line in out.read_text().splitlines() if line)}


def test_openvino_rows_equal_onnxruntimes(exported, photos, tmp_path):
    _, onnx = exported
    outs = {}
    for backend in ("onnxruntime", "openvino"):
        outs[backend] = tmp_path / f"{backend}.jsonl"
        assert main(["predict", str(onnx), str(photos), "--out", str(outs[backend]), "--backend", backend,
                     "--precision", "f32", "--threads", "1", "--top-k", "10", "--quiet"]) == 0
    ort, ov = _rows(outs["onnxruntime"]), _rows(outs["openvino"])
    assert sorted(ort) == sorted(ov) and len(ov) == 4
    for path, row in ov.items():
        assert row["indices"][:3] == ort[path]["indices"][:3]
        scores = dict(zip(row["indices"], row["scores"], strict=True))
        ref = dict(zip(ort[path]["indices"], ort[path]["scores"], strict=True))
        np.testing.assert_allclose([scores[i] for i in range(10)], [ref[i] for i in range(10)], atol=1e-5)
    manifest = json.loads(outs["openvino"].with_name("openvino.jsonl.manifest.json").read_text())
    assert "openvino" in json.dumps(manifest)


def test_a_checkpoint_on_openvino_is_one_line(exported, photos, tmp_path, capsys):
    ckpt, _ = exported
    code = main(["predict", str(ckpt), str(photos), "--out", str(tmp_path / "p.jsonl"), "--backend", "openvino",
                 "--quiet"])
    err = capsys.readouterr().err
    assert code != 0 and "--backend openvino runs exports (NAME.onnx, NAME.xml), not tiny.safetensors" in err
