"""vit_export.quantize: dynamic and static (QDQ, calibrated) int8, side by side against the fp32 graph.

References: onnxruntime (CPU) running the fp32 graph, and the labels of scikit-learn's handwritten digits (real
scans). The model is a small ViT with random weights and a linear head fitted in closed form (ridge regression) on
its features of the digits training scans, so that its predictions vary and agreement with fp32 means something.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

import vit_serve

pytest.importorskip("onnxruntime")
pytest.importorskip("sklearn")

from vit_export.onnx_export import export_onnx
from vit_export.quantize import compare_schemes, quantize_int8, quantize_static_int8, weight_matmuls

from vit_serve.data import DIGITS_LABELS, digits_images, digits_tensors
from vit_serve.preprocess import PreprocessConfig

RES = 32
AGREEMENT_MIN = 0.95  # measured 96.7-98.1% (static, 16-256 calibration scans) and 98.1% (dynamic) on 359 scans


@pytest.fixture(scope="module")
def digits(tmp_path_factory, randomize, fit_head):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("int8")
    pre = PreprocessConfig(input_size=(RES, RES))
    xt, yt = digits_tensors("train", pre)
    xv, yv = digits_tensors("test", pre)
    model = randomize(vit_serve.create_model("Ti/16", num_classes=10, depth=2, img_size=RES), seed=0)
    fit_head(model, xt, yt)
    model.labels = list(DIGITS_LABELS)
    return {"dir": d, "model": model, "fp32": export_onnx(model, d / "fp32.onnx"),
            "train": (xt, yt), "test": (xv, yv)}


def test_static_int8_agrees_with_fp32_on_real_scans(digits):
    d, (xt, _), (xv, yv) = digits["dir"], digits["train"], digits["test"]
    static = quantize_static_int8(digits["fp32"], d / "static.onnx", xt[:64].numpy())
    dynamic = quantize_int8(digits["fp32"], d / "dynamic.onnx")
    ops = Counter(n.op_type for n in onnx.load(str(static)).graph.node)
    # every linear layer (qkv, proj, fc1, fc2 per block, and the head) behind a QuantizeLinear/DequantizeLinear pair
    assert ops["QuantizeLinear"] >= 2 * 4 + 1 and ops["DequantizeLinear"] >= ops["QuantizeLinear"], ops
    assert len(weight_matmuls(digits["fp32"])) == 2 * 4 + 1

    rep = compare_schemes(digits["fp32"], {"dynamic": dynamic, "static": static}, xv.numpy(), yv.numpy(), threads=1,
                          calibration="64 digits training scans")
    fp32, dyn, sta = rep.rows
    assert [r.graph for r in rep.rows] == ["fp32", "int8 dynamic", "int8 static"] and rep.n == len(yv) == 359
    assert fp32.accuracy > 0.9  # the fp32 model really classifies: agreement is not that of a constant answer
    assert sta.agreement >= AGREEMENT_MIN and dyn.agreement >= AGREEMENT_MIN, rep.table()
    # U8U8 (no VPMADDUBSW saturation on CPUs without VNNI): measured 3.0 points on an AVX2-only CPU (96.9 -> 93.9%)
    assert abs(sta.accuracy - fp32.accuracy) < 0.035, rep.table()
    assert sta.mb < 0.5 * fp32.mb and dyn.mb < 0.5 * fp32.mb
    assert "int8 static" in rep.table() and "calibrated on 64 digits training scans" in rep.table()


def test_export_caps_calibration_like_the_library():
    from vit_export import pipeline, quantize

    assert pipeline.MAX_CALIBRATION == quantize.MAX_CALIBRATION and pipeline.SCHEMES == quantize.SCHEMES


def test_calibration_must_be_a_batch(digits, tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        quantize_static_int8(digits["fp32"], tmp_path / "x.onnx", np.zeros((0, 3, RES, RES), np.float32))


def test_export_writes_static_int8_and_reports_both_schemes(digits, tmp_path, capsys):
    """`vit_export.export` with precision int8, int8_scheme static, calibration_images and check_images (labelled
    folders): the static graph is written, and the sidecar and table hold fp32, dynamic and static side by side."""
    import vit_export

    ckpt = tmp_path / "digits.safetensors"
    vit_serve.save(digits["model"], ckpt)
    for split, folder, n in (("train", "calib", 40), ("test", "check", 30)):
        images, labels = digits_images(split)
        for i in range(n):
            (tmp_path / folder / str(labels[i])).mkdir(parents=True, exist_ok=True)
            images[i].save(tmp_path / folder / str(labels[i]) / f"{i}.png")
    out = tmp_path / "out"
    options = vit_export.ExportOptions(precision="int8", int8_scheme="static", out=out,
                                       calibration_images=tmp_path / "calib", check_images=tmp_path / "check")
    result = vit_export.export(ckpt, options, progress=print)
    text = capsys.readouterr().out
    assert result.ok, text
    assert result.graph.int8 == json.loads(result.graph.manifest.read_text())["int8"]
    graph = out / f"digits_{RES}_int8.onnx"
    assert Counter(n.op_type for n in onnx.load(str(graph)).graph.node)["QuantizeLinear"] > 0  # static, not dynamic
    side = json.loads(graph.with_suffix(".json").read_text())
    assert side["precision"] == "int8" and side["int8_scheme"] == "static"
    rows = {r["graph"]: r for r in side["int8"]["rows"]}
    assert set(rows) == {"fp32", "int8 dynamic", "int8 static"} and side["int8"]["n"] == 30
    assert all(r["accuracy"] is not None for r in rows.values())  # labelled folders give accuracy
    assert "static calibrated on 40 images of" in text and "int8 static" in text
