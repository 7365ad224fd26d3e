"""vit_export.export(model, options) -> ExportResult: the pipeline as a Python API.

References: the `vit-export` command on the same checkpoint (the files and manifests it writes), onnxruntime
(inside the parity checks) and the manifests as `vit_serve.manifest` reads them back.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import vit_serve

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import vit_export
from vit_export import ExportOptions, OptionError, OutputExistsError

from vit_serve.manifest import read_manifest

RES = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, randomize) -> Path:
    model = randomize(vit_serve.create_model("Ti/16", num_classes=3, depth=1, img_size=RES), seed=4)
    model.labels = ["cat", "dog", "fox"]
    return vit_serve.save(model, tmp_path_factory.mktemp("pipeline") / "tiny.safetensors")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_writes_what_the_cli_writes(ckpt, tmp_path, capsys):
    from vit_export.cli import main

    cli_dir, api_dir = tmp_path / "cli", tmp_path / "api"
    assert main([str(ckpt), "--format", "onnx,triton", "--out", str(cli_dir / "out"), "--repo",
                 str(cli_dir / "repo")]) == 0
    printed = capsys.readouterr().out
    seen: list[str] = []
    options = ExportOptions(formats="triton,onnx", out=api_dir / "out", repo=api_dir / "repo")
    result = vit_export.export(ckpt, options, progress=seen.append)

    assert result.ok and result.graphs_ok and result.engine is None and result.tensorrt_unavailable is None
    out = api_dir / "out"
    assert (result.name, result.resolution, result.source_checkpoint) == (f"tiny_{RES}", (RES, RES), ckpt)
    assert (result.onnx, result.explain_onnx) == (out / f"tiny_{RES}.onnx", out / f"tiny_{RES}_explain.onnx")
    assert result.manifests == (out / f"tiny_{RES}.json", out / f"tiny_{RES}_explain.json")
    assert sorted((w.model, w.version) for w in result.triton) == sorted(
        (p.name, 1) for p in (api_dir / "repo").iterdir())
    assert all(w.path == api_dir / "repo" / w.model / "1" for w in result.triton)
    assert result.graph.parity.ok and result.explain.parity.ok and result.graph.int8 is None
    # The same files, byte for byte: graphs, manifests (no times in them; the checkpoint's path is the same),
    # the Triton configs and version folders.
    cli_files, api_files = _tree(cli_dir), _tree(api_dir)
    assert len(cli_files) > 20 and sorted(cli_files) == sorted(api_files)
    assert [n for n in cli_files if cli_files[n] != api_files[n]] == []
    assert read_manifest(result.onnx).source_checkpoint.path == str(ckpt)
    # What the CLI prints is the API's progress, line for line (but the folder names and timings).
    def same(text: str, root: Path) -> str:
        return re.sub(r"in \d+\.\ds;", "in Ts;", text.strip().replace(str(root), "X"))

    assert same("\n".join(seen), api_dir) == same(printed, cli_dir)


def test_a_loaded_model_with_progress_on_the_logger(ckpt, tmp_path, caplog):
    model = vit_serve.load(ckpt)
    with caplog.at_level(logging.INFO, logger="vit_export"):
        result = vit_export.export(model, ExportOptions(res="32x48", out=tmp_path, name="wide"))
    assert result.ok and result.onnx == tmp_path / "wide.onnx" and result.resolution == (32, 48)
    m = read_manifest(result.onnx)
    assert m.source_checkpoint is None and m.resolution == (32, 48) and m.labels == ("cat", "dog", "fox")
    assert m.parity.ok and m.parity.to_dict()["rows"] == [vars(r) for r in result.graph.parity.rows]
    assert f"wrote {result.explain_onnx} and wide_explain.json" in caplog.messages
    assert model.cfg.img_size == (RES, RES)  # the caller's model is left at its own resolution
    dyn = vit_export.export(model, ExportOptions(res="dynamic", out=tmp_path, batch=2))
    assert dyn.name == "vit_dynamic" and read_manifest(dyn.onnx).resolution == "dynamic"
    assert read_manifest(dyn.onnx).batch == 2


@pytest.mark.parametrize(
    ("options", "option", "needle"),
    [
        ({"opset": 16}, "opset", "opset 16 is too old"),
        ({"formats": "onnx,coreml"}, "formats", "unknown format 'coreml'"),
        ({"formats": ("triton",), "batch": 8}, "batch", "formats triton needs batch dynamic (got 8)"),
        ({"formats": ("tensorrt",), "res": "dynamic"}, "res", "formats tensorrt needs a fixed res"),
        ({"formats": ("tensorrt",), "precision": "int8"}, "precision", "builds from an fp32 or fp16 graph"),
        ({"triton_ensemble": "trt"}, "triton_ensemble", "triton_ensemble trt needs formats tensorrt"),
        ({"calibration_images": "x"}, "calibration_images", "calibration_images calibrates static int8"),
        ({"precision": "int8", "int8_scheme": "static"}, "int8_scheme", "static needs images to calibrate on"),
        ({"res": "big"}, "res", "bad resolution 'big'"),
        ({"res": (32, 0)}, "res", "bad resolution (32, 0)"),
        ({"batch": 0}, "batch", "bad batch 0"),
        ({"precision": "int4"}, "precision", "precision 'int4' is not one of 'fp32', 'fp16', 'int8'"),
        ({"max_batch": 0}, "max_batch", "max_batch must be a positive integer"),
        ({"discard_ratio": 1.0}, "discard_ratio", "discard_ratio must be in [0, 1)"),
        ({"tol": -1.0}, "tol", "tol must be a positive number"),
        ({"queue_delay_us": -1}, "queue_delay_us", "queue_delay_us must be >= 0"),
    ],
)
def test_bad_options_are_value_errors_naming_the_option(options, option, needle):
    with pytest.raises(ValueError) as info:
        ExportOptions(**options)
    assert isinstance(info.value, OptionError) and info.value.option == option
    assert needle in str(info.value) and "--" not in str(info.value), str(info.value)


def test_options_are_normalised_and_frozen():
    o = ExportOptions(res=384, formats="triton, onnx,triton", batch="DYNAMIC", out="x", check_images="imgs")
    assert (o.res, o.formats, o.batch, o.out, o.check_images) == ((384, 384), ("onnx", "triton"), "dynamic",
                                                                  Path("x"), Path("imgs"))
    assert ExportOptions(res="224x320").res == (224, 320) and ExportOptions(formats=()).formats == ("onnx",)
    with pytest.raises(AttributeError):
        o.res = (224, 224)  # type: ignore[misc]


def test_image_folders_are_checked_before_any_work(ckpt, tmp_path):
    (tmp_path / "empty").mkdir()
    for folder, needle in (("missing", "no such folder"), ("empty", "no jpg/jpeg/png")):
        with pytest.raises(OptionError, match=f"check_images: {needle}") as info:
            vit_export.export(ckpt, ExportOptions(out=tmp_path / "out", check_images=tmp_path / folder))
        assert info.value.option == "check_images"
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_kept_without_force(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "m_explain.json").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"m_explain\.json exists; pass force=True") as info:
        vit_export.export(ckpt, ExportOptions(out=out, name="m"))
    assert isinstance(info.value, OutputExistsError) and info.value.path == out / "m_explain.json"
    assert [p.name for p in out.iterdir()] == ["m_explain.json"] and (out / "m_explain.json").read_text() == "keep me"
    result = vit_export.export(ckpt, ExportOptions(out=out, name="m", force=True))
    assert result.ok and read_manifest(out / "m_explain.json").explain
