"""`vit-export --format`: the known formats, and the combinations refused before any work is done.

The full onnx + triton (+ tensorrt where unavailable: exit code 3) run is in test_triton.py.
"""

from __future__ import annotations

import pytest
from vit_export.cli import FORMATS, build_parser, main

import vit_serve


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, randomize):
    path = tmp_path_factory.mktemp("formats") / "tiny.safetensors"
    vit_serve.save(randomize(vit_serve.create_model("Ti/16", num_classes=3, depth=1, img_size=32)), path)
    return path


def test_unknown_format_lists_the_known_ones(ckpt, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(ckpt), "--format", "onnx,coreml"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "unknown format 'coreml'; known formats: onnx, openvino, tensorrt, triton" in err
    assert FORMATS == ("onnx", "openvino", "tensorrt", "triton")


def test_formats_are_deduplicated_in_pipeline_order():
    args = build_parser().parse_args(["x.safetensors", "--format", "triton, onnx,tensorrt,triton"])
    assert args.format == ["onnx", "tensorrt", "triton"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--format", "triton", "--batch", "8"], "--format triton needs --batch dynamic"),
        (["--format", "tensorrt", "--batch", "8"], "--format tensorrt needs --batch dynamic"),
        (["--format", "tensorrt", "--precision", "int8"], "builds from an fp32 or fp16 graph"),
        (["--format", "triton", "--triton-ensemble", "trt"], "--triton-ensemble trt needs --format tensorrt"),
        # main let this through to fail deep inside TensorRT, after the ONNX files were written
        (["--format", "tensorrt", "--res", "dynamic"], "--format tensorrt needs a fixed --res"),
        (["--format", "onnx,tensorrt,triton", "--res", "dynamic"], "--format tensorrt needs a fixed --res"),
        (["--calibration-images", "{calib}"], "--calibration-images calibrates static int8"),
        (["--precision", "int8", "--int8-scheme", "static"], "--int8-scheme static needs images to calibrate on"),
        (["--precision", "int8", "--calibration-images", "{missing}"], "--calibration-images: no such folder"),
        (["--precision", "int8", "--calibration-images", "{empty}"], "--calibration-images: no jpg/jpeg/png"),
    ],
)
def test_refused_combinations_write_nothing(ckpt, tmp_path, capsys, args, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an image")
    dirs = {"calib": str(tmp_path / "empty"), "missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty")}
    args = [a.format(**dirs) for a in args]
    rc = main([str(ckpt), "--out", str(tmp_path / "out"), "--repo", str(tmp_path / "repo"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "repo").exists()


def test_help_documents_the_layout_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--repo", "<name>_ensemble", "model_sm<XY>.plan", "3 tensorrt requested but unavailable"):
        assert needle in text
