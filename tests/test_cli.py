"""`vit-serve convert`, run as a user would: through the installed console script when present."""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import vit_serve


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("vit-serve")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "vit_serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def timm_file(tmp_path, randomize):
    timm = pytest.importorskip("timm")
    ref = randomize(timm.create_model("vit_tiny_patch16_224", num_classes=1000, depth=2))
    path = tmp_path / "timm_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    return ref, path


def test_convert_at_new_resolution_with_new_head(timm_file, tmp_path):
    ref, src = timm_file
    dst = tmp_path / "out" / "tiny384.safetensors"
    r = run_cli("convert", str(src), str(dst), "--res", "384", "--num-classes", "10",
                "--arch", "vit_tiny_patch16_224")
    assert r.returncode == 0, r.stderr
    assert f"wrote {dst}" in r.stdout and "384x384, 10 classes" in r.stdout
    model = vit_serve.load(dst)
    assert model.cfg.img_size == (384, 384) and model.cfg.num_classes == 10
    assert model.preprocess_cfg.input_size == (384, 384)
    assert not model.head.weight.any()
    # The converted trunk equals timm's own on-the-fly resampling at 384.
    from timm.layers import resample_abs_pos_embed

    expected = resample_abs_pos_embed(ref.pos_embed.detach(), [24, 24], [14, 14])
    assert (model.pos_embed - expected).abs().max() <= 1e-6


def test_convert_keeps_labels_and_refuses_to_overwrite(timm_file, tmp_path):
    _, src = timm_file
    dst = tmp_path / "m.safetensors"
    assert run_cli("convert", str(src), str(dst), "--arch", "vit_tiny_patch16_224").returncode == 0
    assert vit_serve.load(dst).labels[:2] == ["tench", "goldfish"]
    before = dst.read_bytes()
    r = run_cli("convert", str(src), str(dst), "--res", "256", "--arch", "vit_tiny_patch16_224")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == f"vit-serve convert: error: {dst} exists; pass overwrite=True (CLI: --force) to " \
                               "replace it"
    assert dst.read_bytes() == before
    assert run_cli("convert", str(src), str(dst), "--res", "256", "--force", "--arch",
                   "vit_tiny_patch16_224").returncode == 0
    assert vit_serve.load(dst).cfg.img_size == (256, 256)


@pytest.mark.parametrize("args, message", [
    (["--res", "380"], "input size 380x380 is not a multiple of the patch size 16; nearest valid sizes: "
                       "height 368 or 384"),
    (["--res", "big"], "bad resolution 'big'"),
])
def test_convert_bad_resolution(timm_file, tmp_path, args, message):
    _, src = timm_file
    dst = tmp_path / "m.safetensors"
    r = run_cli("convert", str(src), str(dst), "--arch", "vit_tiny_patch16_224", *args)
    assert r.returncode != 0 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not dst.exists()


def test_convert_unknown_and_corrupt_inputs(tmp_path):
    odd = tmp_path / "odd.safetensors"
    save_file({"foo": torch.zeros(1)}, odd)
    r = run_cli("convert", str(odd), str(tmp_path / "o.safetensors"))
    assert r.returncode == 1 and "unknown checkpoint format" in r.stderr and "Traceback" not in r.stderr
    assert "vit_jax / big_vision .npz" in r.stderr
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 truncated")
    r = run_cli("convert", str(bad), str(tmp_path / "o.safetensors"))
    assert r.returncode == 1 and "truncated or corrupt .npz file" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_version_and_help():
    assert run_cli("--version").stdout.strip() == f"vit-serve {vit_serve.__version__}"
    assert "--num-classes" in run_cli("convert", "--help").stdout


def _train_flag_cases():
    """(field, argv, expected value) for every TrainConfig field: a new field is covered automatically."""
    import dataclasses
    import typing

    from vit_serve.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    samples = {int: ("3", 3), float: ("0.25", 0.25), str: ("some-value", "some-value")}
    special = {"res": ("12x16", (12, 16)), "model_args": ("depth=2,gelu=tanh", {"depth": 2, "gelu": "tanh"}),
               "few_shot": ("1,5", (1, 5))}
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kinds = {hints[f.name], *typing.get_args(hints[f.name])} - {type(None)}
        if bool in kinds:
            yield f.name, [flag], True
            yield f.name, ["--no-" + flag[2:]], False
        elif f.name in special:
            yield f.name, [flag, special[f.name][0]], special[f.name][1]
        else:
            (kind,) = kinds & set(samples)
            yield f.name, [flag, samples[kind][0]], samples[kind][1]


@pytest.mark.parametrize("name, argv, expected", list(_train_flag_cases()),
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_train_flag_parses_to_its_type(name, argv, expected):
    from vit_serve.cli import build_parser

    args = build_parser().parse_args(["train", *argv])
    assert getattr(args, name) == expected and type(getattr(args, name)) is type(expected)
    assert getattr(build_parser().parse_args(["train"]), name) is None  # unset: the file or the recipe decides


def test_boolean_flags_override_the_recipe_and_refuse_values(tmp_path):
    from vit_serve.cli import build_parser
    from vit_serve.train.config import resolve

    # The pretrain recipe turns flips and the Inception crop on (for data other than digits); --no-* wins.
    args = build_parser().parse_args(["train", "--data", "imgs", "--no-flip", "--no-inception-crop"])
    cfg = resolve(None, {k: v for k, v in vars(args).items() if k not in ("command", "func", "config")})
    assert cfg.flip is False and cfg.inception_crop is False
    assert resolve(None, {"data": "imgs"}).flip is True
    r = run_cli("train", "--flip", "false", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress")
    assert r.returncode == 2 and "unrecognized arguments: false" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_grad_clip_comes_from_the_recipe_and_zero_turns_it_off(tmp_path):
    from vit_serve.train.config import resolve

    assert resolve(None, {}).grad_clip == 1.0  # the paper's clipping at global norm 1
    assert resolve(None, {"mode": "finetune", "init": "src.safetensors", "data": "imgs"}).grad_clip == 1.0
    # the digits' fine-tune does not clip (measured: benchmarks/digits_transfer.py --part default)
    assert resolve(None, {"mode": "finetune", "init": "src.safetensors"}).grad_clip == 0.0
    assert resolve(None, {"mode": "finetune", "init": "src.safetensors", "grad_clip": 1.0}).grad_clip == 1.0
    assert resolve(None, {"grad_clip": 0.0}).grad_clip == 0.0  # a flag wins over the recipe
    r = run_cli("train", "--grad-clip", "-1", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress")
    assert r.returncode == 2 and "--grad-clip must be at least 0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
