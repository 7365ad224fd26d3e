"""vit_serve.inspect and `vit-serve inspect`: the paper's Figure 6/7 inspections, tiny random models, real photos."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vit_serve
from vit_serve import explain
from vit_serve.cli import main
from vit_serve.preprocess import PreprocessConfig, preprocess, resize_and_crop

pytest.importorskip("matplotlib")
skdata = pytest.importorskip("skimage.data")

from vit_serve.inspect import check_out_dir, default_images, find_images, inspect_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LABELS = [f"class-{i}" for i in range(10)]
NAMES = ["chelsea", "astronaut"]

# Pixel sizes (W, H) of the figures at dpi 120, for a 64x64 Ti/16 (4x4 grid, 3 heads) and two photos.
FIGURE_SIZES = {
    "filters.png": (1092, 756),  # 4 x 7 tiles
    "pos_embed_similarity.png": (1008, 996),
    "mean_attention_distance.png": (864, 552),
    "rollout.png": (1514, 474),  # two (crop, overlay) pairs in one row
    "rollout_chelsea.png": (64, 64),  # the model-input crop
    "rollout_astronaut.png": (64, 64),
}


def photos() -> list[Image.Image]:
    return [Image.fromarray(skdata.chelsea()), Image.fromarray(skdata.astronaut())]


def tiny(randomize, **overrides) -> vit_serve.VisionTransformer:
    kw = {"depth": 2, "img_size": 64, "num_classes": 10, **overrides}
    torch.manual_seed(0)
    model = randomize(vit_serve.create_model("Ti/16", **kw))
    model.labels = list(LABELS)
    return model


def assert_not_blank(path: Path) -> np.ndarray:
    a = np.asarray(Image.open(path).convert("RGB")).astype(np.int64)
    assert a.std() > 10, f"{path.name} looks blank (std {a.std():.1f})"
    colours = np.unique((a[..., 0] << 16) | (a[..., 1] << 8) | a[..., 2])
    assert len(colours) > 50, f"{path.name} has almost no colours ({len(colours)})"
    return a


@pytest.fixture(scope="module")
def run(tmp_path_factory, randomize):
    model = tiny(randomize)
    out = tmp_path_factory.mktemp("inspect") / "out"
    result = inspect_model(model, photos(), out, names=NAMES)
    return model, out, result


def test_writes_readable_figures(run):
    _, out, result = run
    assert sorted(p.name for p in out.iterdir()) == sorted([*FIGURE_SIZES, "inspect.json"])
    assert result["files"] == [*FIGURE_SIZES, "inspect.json"]
    for name, size in FIGURE_SIZES.items():
        img = Image.open(out / name)
        img.load()
        assert img.format == "PNG" and img.size == size, name
        assert_not_blank(out / name)


def test_json_has_every_number(run):
    model, out, result = run
    on_disk = json.loads((out / "inspect.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["model"]["config"]["patch_size"] == 16 and on_disk["model"]["input_grid"] == [4, 4]
    assert on_disk["settings"]["head_fusion"] == "mean" and on_disk["settings"]["discard_ratio"] == 0.9

    filters = on_disk["filters"]
    ratios = np.array(filters["explained_variance_ratio"])
    assert filters["file"] == "filters.png" and filters["filter_shape"] == [3, 16, 16] and ratios.shape == (28,)
    assert (np.diff(ratios) <= 1e-12).all() and 0 < ratios.sum() <= 1

    sim = np.array(on_disk["pos_embed_similarity"]["similarity"])
    assert sim.shape == (4, 4, 4, 4)
    np.testing.assert_allclose(np.einsum("ijij->ij", sim), 1.0, atol=1e-6)  # each position vs itself
    np.testing.assert_allclose(sim, sim.transpose(2, 3, 0, 1), atol=1e-6)

    mad = on_disk["mean_attention_distance"]
    values = np.array(mad["values"])
    assert mad["unit"] == "pixels" and values.shape == (2, 3) == tuple(mad["shape"])  # [layers, heads]
    assert (values > 0).all() and (values < np.hypot(64, 64)).all()

    roll = on_disk["rollout"]
    assert roll["query"] == "cls" and [im["name"] for im in roll["images"]] == NAMES
    cfg = PreprocessConfig(input_size=(64, 64))
    for photo, entry in zip(photos(), roll["images"], strict=True):
        assert entry["query"] == "cls" and entry["file"] == f"rollout_{entry['name']}.png"
        heat = np.array(entry["map"])
        assert heat.shape == (4, 4)
        with torch.no_grad():
            logits, attn = model(preprocess(photo, cfg)[None], return_attention=True)
        ref = explain.rollout(attn, (4, 4), 1, "token", "mean", 0.9).map[0]
        np.testing.assert_allclose(heat, ref.double().numpy(), rtol=1e-5, atol=1e-7)
        top = entry["top5"]
        assert len(top) == 5 and [t["label"] for t in top] == [LABELS[t["index"]] for t in top]
        scores = [t["score"] for t in top]
        assert scores == sorted(scores, reverse=True) and sum(scores) <= 1 + 1e-6
        assert top[0]["index"] == int(logits.argmax())


def test_gap_model_reads_patch_mean(tmp_path, randomize):
    model = tiny(randomize, pool="gap", class_token=False)
    result = inspect_model(model, photos(), tmp_path / "gap", head_fusion="max", discard_ratio=0.5)
    assert result["rollout"]["query"] == "patch-mean"
    assert all(im["query"] == "patch-mean" for im in result["rollout"]["images"])
    assert np.array(result["pos_embed_similarity"]["similarity"]).shape == (4, 4, 4, 4)
    assert_not_blank(tmp_path / "gap" / "rollout.png")


def test_register_model_shows_class_and_register_attention(tmp_path, randomize, run):
    """Darcet et al. 2024 ("Vision Transformers Need Registers"), Figure 1: the last layer's head-mean attention of
    [class] and of each register over the patches. Reference: the model's own attentions (timm token order
    [cls, reg1..reg4, patches]); a model without registers says why there is no figure."""
    assert run[2]["registers"] == {"skipped": "the model has no register tokens"}
    assert "registers.png" not in run[2]["files"]
    model = tiny(randomize, reg_tokens=4, no_embed_class=True)
    out = tmp_path / "reg"
    result = inspect_model(model, photos(), out, names=NAMES)
    assert "registers.png" in result["files"] and result["files"][-1] == "inspect.json"
    img = Image.open(out / "registers.png")
    assert img.format == "PNG" and img.width > img.height  # one row per image, a column per token
    assert_not_blank(out / "registers.png")
    reg = json.loads((out / "inspect.json").read_text())["registers"]
    assert reg["file"] == "registers.png" and reg["layer"] == 2 and reg["head_fusion"] == "mean"
    assert reg["tokens"] == ["class", "reg1", "reg2", "reg3", "reg4"]
    cfg = PreprocessConfig(input_size=(64, 64))
    for photo, entry in zip(photos(), reg["images"], strict=True):
        maps = np.array(entry["maps"])
        assert entry["grid"] == [4, 4] and maps.shape == (5, 4, 4)  # 1 + R maps of the grid's shape
        with torch.no_grad():
            _, attn = model(preprocess(photo, cfg)[None], return_attention=True)
        last = attn[-1][0].double().mean(dim=0)  # [N, N], N = 1 + 4 + 16
        assert last.shape == (21, 21)
        for row in range(5):  # [class] is token 0, the registers 1..4; the patches start at 5
            np.testing.assert_allclose(maps[row], last[row, 5:].reshape(4, 4).numpy(), rtol=1e-5, atol=1e-7)
        assert not np.allclose(maps[0], maps[1])


def test_hybrid_skips_filters_with_a_reason(tmp_path, randomize):
    model = tiny(randomize, resnet_layers=(1,), resnet_width=32, patch_size=16)
    out = tmp_path / "hybrid"
    result = inspect_model(model, photos(), out)
    assert "hybrid" in result["filters"]["skipped"] and "file" not in result["filters"]
    assert not (out / "filters.png").exists() and "filters.png" not in result["files"]
    for name in ("pos_embed_similarity.png", "mean_attention_distance.png", "rollout.png"):
        assert_not_blank(out / name)
    assert np.array(result["mean_attention_distance"]["values"]).shape == (2, 3)


def test_non_square_input(tmp_path, randomize):
    model = tiny(randomize, img_size=(48, 80))
    out = tmp_path / "wide"
    result = inspect_model(model, photos(), out, names=NAMES)
    assert result["model"]["input_grid"] == [3, 5]
    assert np.array(result["pos_embed_similarity"]["similarity"]).shape == (3, 5, 3, 5)
    assert all(np.array(im["map"]).shape == (3, 5) for im in result["rollout"]["images"])
    assert Image.open(out / "rollout_chelsea.png").size == (80, 48)
    assert Image.open(out / "pos_embed_similarity.png").size == (1008, 474)
    for name in result["files"][:-1]:
        assert_not_blank(out / name)


def test_out_dir_is_not_overwritten(tmp_path, randomize):
    model = tiny(randomize)
    out = tmp_path / "out"
    out.mkdir()  # an existing empty folder is fine
    inspect_model(model, photos()[:1], out)
    before = (out / "inspect.json").read_bytes()
    with pytest.raises(FileExistsError, match=r"not empty; pass overwrite=True"):
        inspect_model(model, photos(), out)
    assert (out / "inspect.json").read_bytes() == before
    result = inspect_model(model, photos(), out, overwrite=True)
    assert len(result["rollout"]["images"]) == 2
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        check_out_dir(tmp_path / "file", overwrite=True)


def test_bad_arguments(tmp_path, randomize):
    model = tiny(randomize)
    with pytest.raises(ValueError, match=r"discard_ratio must be in \[0, 1\)"):
        inspect_model(model, photos(), tmp_path / "a", discard_ratio=1.0)
    with pytest.raises(ValueError, match="head_fusion"):
        inspect_model(model, photos(), tmp_path / "a", head_fusion="median")
    with pytest.raises(ValueError, match="1 names for 2 images"):
        inspect_model(model, photos(), tmp_path / "a", names=["x"])
    with pytest.raises(ValueError, match="no images"):
        inspect_model(model, [], tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_keeps_training_mode_and_unique_names(tmp_path, randomize):
    model = tiny(randomize).train()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    photo = photos()[0]
    photo.save(a / "cat.jpg"), photo.save(b / "cat.jpg")
    result = inspect_model(model, [a / "cat.jpg", b / "cat.jpg"], tmp_path / "out")
    assert model.training
    assert [im["name"] for im in result["rollout"]["images"]] == ["cat", "cat_2"]
    # dropout is off while inspecting: both copies give the same map
    np.testing.assert_array_equal(*(np.array(im["map"]) for im in result["rollout"]["images"]))


def test_find_and_default_images(tmp_path):
    for name in ("b.PNG", "a.jpg", "c.webp", "notes.txt", "d.jpeg"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in find_images(tmp_path)] == ["a.jpg", "b.PNG", "c.webp", "d.jpeg"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        find_images(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        find_images(tmp_path / "missing")
    defaults = default_images()
    assert defaults[0].name == "grace_hopper.jpg" and all(p.is_file() for p in defaults)


# -- the command ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory, randomize):
    root = tmp_path_factory.mktemp("cli")
    ckpt = root / "tiny.safetensors"
    vit_serve.save(tiny(randomize), ckpt)
    images = root / "images"
    images.mkdir()
    for name, photo in zip(NAMES, photos(), strict=True):
        photo.save(images / f"{name}.jpg", quality=90)
    return root, ckpt, images


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "vit_serve", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_inspect(cli_inputs):
    root, ckpt, images = cli_inputs
    out = root / "out"
    r = run_cli(
        "inspect",
        str(ckpt),
        "--images",
        str(images),
        "--out",
        str(out),
        "--head-fusion",
        "min",
        "--discard-ratio",
        "0.5",
    )
    assert r.returncode == 0, r.stderr
    expected = [*FIGURE_SIZES, "inspect.json"]
    expected[4:6] = ["rollout_astronaut.png", "rollout_chelsea.png"]  # the folder's files, sorted by name
    assert r.stdout.splitlines() == [str(out / name) for name in expected]
    assert all((out / name).is_file() for name in expected)
    data = json.loads((out / "inspect.json").read_text())
    assert data["settings"]["head_fusion"] == "min" and data["settings"]["discard_ratio"] == 0.5
    assert [im["top5"][0]["label"] in LABELS for im in data["rollout"]["images"]] == [True, True]
    assert [im["source"] for im in data["rollout"]["images"]] == [
        str(images / "astronaut.jpg"),
        str(images / "chelsea.jpg"),
    ]
    # the same folder again: refused without --force, then accepted with it
    r = run_cli("inspect", str(ckpt), "--images", str(images), "--out", str(out))
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"vit-serve inspect: error: {out} exists and is not empty; pass overwrite=True (CLI: --force) to write into it"
    ]
    assert main(["inspect", str(ckpt), "--images", str(images), "--out", str(out), "--force"]) == 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing checkpoint", "no such file"),
        ("empty image folder", "no image files"),
        ("discard ratio 1", "discard_ratio must be in [0, 1)"),
        ("discard ratio -0.1", "discard_ratio must be in [0, 1)"),
        ("bad head fusion", "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line(cli_inputs, tmp_path, capsys, case, message):
    _, ckpt, images = cli_inputs
    (tmp_path / "empty").mkdir()
    args = {
        "missing checkpoint": [str(tmp_path / "nope.safetensors"), "--images", str(images)],
        "empty image folder": [str(ckpt), "--images", str(tmp_path / "empty")],
        "discard ratio 1": [str(ckpt), "--images", str(images), "--discard-ratio", "1"],
        "discard ratio -0.1": [str(ckpt), "--images", str(images), "--discard-ratio=-0.1"],
        "bad head fusion": [str(ckpt), "--images", str(images), "--head-fusion", "median"],
    }[case]
    rc = cli_rc(["inspect", *args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr()
    assert rc != 0 and err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and message in err.err
    assert err.err.startswith("vit-serve inspect: error: ")
    assert not (tmp_path / "out").exists()


def cli_rc(argv: list[str]) -> int:
    """main(argv)'s exit status, whether returned or raised by argparse (usage errors)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_cli_bad_input_in_a_subprocess(cli_inputs, tmp_path):
    _, _, images = cli_inputs
    r = run_cli("inspect", str(tmp_path / "missing.safetensors"), "--images", str(images), "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"vit-serve inspect: error: no such file: {tmp_path / 'missing.safetensors'}"
    ]


# -- token merging --------------------------------------------------------------------------------------


def test_tome_draws_the_merged_groups_and_rolls_out_through_them(tmp_path, randomize, run):
    """`tome=R`: per image the ToMe paper's visualisation (Bolya et al. 2023, Figure 4; facebookresearch/ToMe
    `tome/vis.py` `make_visualization`): every final token's patches filled with their mean colour, outlined.
    References: the model's own merge sources (`set_token_merging(R, trace_source=True)`, the argmax over tokens
    as the reference does), the crop's pixels, and `explain_forward` with the same merging for the rollout maps;
    the mean attention distance is the plain model's (the `run` fixture, same model and photos)."""
    model = tiny(randomize)
    out = tmp_path / "tome"
    result = inspect_model(model, photos(), out, names=NAMES, tome=4)
    assert model.token_merging is None and model.tome_source is None  # the model's own setting is restored
    assert result["files"][-3:] == ["tome_chelsea.png", "tome_astronaut.png", "inspect.json"]
    tm = json.loads((out / "inspect.json").read_text())["token_merging"]
    assert tm["r"] == 4 and tm["schedule"] == [4, 4] and tm["prop_attn"] is True
    assert tm["tokens"] == [17, 13, 9]  # [class] + 16 patches, minus 4 per layer
    cfg = PreprocessConfig(input_size=(64, 64))
    x = torch.stack([preprocess(p, cfg) for p in photos()])
    model.set_token_merging(4, trace_source=True)
    with torch.no_grad():
        want = explain.explain_forward(model, x, "mean", 0.9)
    groups = model.tome_source[:, :, 1:].argmax(dim=1).reshape(2, 4, 4).numpy()
    model.set_token_merging(0)
    for i, (entry, roll) in enumerate(zip(tm["images"], result["rollout"]["images"], strict=True)):
        g = np.array(entry["groups"])
        np.testing.assert_array_equal(g, groups[i])
        assert entry["tokens"] == len(np.unique(g)) == 8  # every final patch token holds at least one patch
        np.testing.assert_allclose(np.array(roll["map"]), want.heatmap.map[i].double().numpy(), rtol=1e-5, atol=1e-7)
        img = np.asarray(Image.open(out / entry["file"]).convert("RGB")).astype(np.float64)
        crop = np.asarray(resize_and_crop(photos()[i], cfg).convert("RGB")).astype(np.float64)
        assert img.shape == crop.shape == (64, 64, 3)
        labels = np.kron(g, np.ones((16, 16), dtype=int))
        for gy in range(4):
            for gx in range(4):
                mean = crop[labels == g[gy, gx]].mean(axis=0) / 255  # the group's mean colour, at a patch centre
                np.testing.assert_allclose(img[16 * gy + 8, 16 * gx + 8], np.floor(mean * 255), atol=1)
        edges = (labels != np.roll(labels, 1, axis=0)) | (labels != np.roll(labels, 1, axis=1))
        assert not np.allclose(img[edges].std(axis=0), 0)  # group borders are drawn
    assert tm["unmerged"] == ["mean_attention_distance", "registers"]
    assert result["mean_attention_distance"]["values"] == run[2]["mean_attention_distance"]["values"]
    plain = run[2]["rollout"]["images"]
    assert max(np.abs(np.array(a["map"]) - np.array(b["map"])).max()
               for a, b in zip(plain, result["rollout"]["images"], strict=True)) > 1e-3
    assert run[2]["token_merging"] == {"skipped": "token merging is off (CLI: --tome R)"}


def test_tome_on_a_register_model_and_bad_r(tmp_path, randomize):
    model = tiny(randomize, reg_tokens=4, no_embed_class=True)
    result = inspect_model(model, photos(), tmp_path / "reg", names=NAMES, tome=[3, 2])
    assert result["token_merging"]["tokens"] == [21, 18, 16]  # the 5 prefix tokens are never merged
    assert all(np.array(im["groups"]).shape == (4, 4) for im in result["token_merging"]["images"])
    assert "registers.png" in result["files"]
    for bad, message in ((-1, "r must be a whole number >= 0"), ([1, 1, 1], "3 values of r for a model of 2 layers")):
        with pytest.raises(ValueError, match=message):
            inspect_model(model, photos(), tmp_path / "bad", tome=bad)
        assert not (tmp_path / "bad").exists()


def test_cli_inspect_tome(cli_inputs, tmp_path, capsys):
    _, ckpt, images = cli_inputs
    out = tmp_path / "out"
    assert main(["inspect", str(ckpt), "--images", str(images), "--out", str(out), "--tome", "4"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-3:] == [str(out / "tome_astronaut.png"), str(out / "tome_chelsea.png"), str(out / "inspect.json")]
    assert (out / "tome_chelsea.png").is_file()
    data = json.loads((out / "inspect.json").read_text())
    assert data["token_merging"]["r"] == 4 and data["token_merging"]["schedule"] == [4, 4]


@pytest.mark.parametrize(("tome", "message", "code"), [
    ("--tome=-1", "token merging: r must be a whole number >= 0, got -1", 2),
    ("--tome=4,x", "token merging: bad r '4,x'", 2),
    ("--tome=1,1,1", "token merging: 3 values of r for a model of 2 layers", 1),
])
def test_cli_inspect_bad_tome_is_one_line(cli_inputs, tmp_path, capsys, tome, message, code):
    _, ckpt, images = cli_inputs
    rc = cli_rc(["inspect", str(ckpt), "--images", str(images), "--out", str(tmp_path / "out"), tome])
    err = capsys.readouterr()
    assert rc == code and err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and err.err.startswith("vit-serve inspect: error: ")
    assert message in err.err
    assert not (tmp_path / "out").exists()


def test_rope_only_model_skips_the_position_embedding_figure_with_a_reason(tmp_path, randomize):
    """DINOv3-style RoPE without absolute embeddings: nothing to compare, said so; the other figures are made."""
    from vit_serve.config import RopeConfig

    model = tiny(randomize, pos_embed=False, rope=RopeConfig("dinov3", 100.0, rotate_half=True), reg_tokens=2)
    out = tmp_path / "rope"
    result = inspect_model(model, photos(), out, names=NAMES)
    assert "RoPE" in result["pos_embed_similarity"]["skipped"]
    assert not (out / "pos_embed_similarity.png").exists() and "pos_embed_similarity.png" not in result["files"]
    assert_not_blank(out / "mean_attention_distance.png")
    assert result["rollout"]["images"][0]["map"] and (out / "registers.png").is_file()
