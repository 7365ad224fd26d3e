"""Smoke runs of benchmarks/digits_transfer.py (every resample mode x transfer, fine-tune recipes) and
benchmarks/patch_resize.py (FlexiViT rows) at tiny sizes: the tables come out with every row, each cell a held-out
top-1 of the digits test split. Reference: the library's own training loop and evaluation (the resampling itself
is checked against each mode's anchor in tests/test_pos_embed.py, the patch resize against timm in
tests/test_patch_resize.py); no accuracy or timing asserted."""

from __future__ import annotations

import re

from bench_script import load_script

PCT = re.compile(r"^\d+\.\d\d( \(\d+\.\d\d-\d+\.\d\d\))?%?$")


def _rows(out: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines()
            if ln.startswith("| ") and not ln.startswith(f"| {first} |")]


def test_digits_transfer_prints_every_mode_and_transfer_and_the_recipes(capsys, tmp_path):
    m = load_script("digits_transfer")
    recipes = ["clip 1, EMA 0.99", "no clipping (the quickstart's)"]
    m.main(["--tiny", "--out", str(tmp_path), "--modes", "jax,dinov2", "--recipes", ";".join(recipes),
            "--part", "modes,recipes,default"])
    out = capsys.readouterr().out
    out, _, default = out.partition("| stage |")
    stages = _rows("| stage |" + default, "stage")
    assert [r[0].split(",")[0] for r in stages] == [
        "pre-train at 16x16 from scratch", "at 32x32", "at 32x32", "fine-tune at 32x32", "fine-tune at 32x32"], stages
    assert all(PCT.match(r[3]) for r in stages), stages
    table, _, rest = out.partition("| recipe |")
    modes = _rows(table, "mode")
    assert [(r[0], r[1].split()[0]) for r in modes] == [(mode, t) for mode in ("jax", "dinov2")
                                                        for t in ("2x", "4x", "2x1")], out
    assert all(PCT.match(c) for r in modes for c in r[2:]), modes
    recipe_rows = _rows("| recipe |" + rest, "recipe")
    assert [r[0] for r in recipe_rows] == recipes and all(PCT.match(r[1]) for r in recipe_rows), out


def test_patch_resize_prints_each_patch_and_its_token_count(capsys, tmp_path):
    m = load_script("patch_resize")
    m.main(["--tiny", "--out", str(tmp_path)])
    rows = _rows(capsys.readouterr().out, "patch")
    assert [(r[0], r[1], r[2]) for r in rows] == [("4", "32x32", "64"), ("2", "32x32", "256"), ("8", "32x32", "16"),
                                                  ("2", "16x16", "64"), ("8", "64x64", "64")], rows
    assert all(PCT.match(r[3]) for r in rows) and rows[0][4] == "(source)" and rows[0][6] == "1.00x", rows
