"""Every picture README.md and the docs show exists, and every picture benchmarks/figures.py makes is in
docs/assets/ as a real PNG (regenerate them with `python benchmarks/figures.py`)."""

from __future__ import annotations

import re
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
# ![alt](path "title") and <img src="path">: the two ways markdown pages show a picture
PICTURE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img\s[^>]*src=[\"']([^\"']+)[\"']")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def pictures(page: Path) -> list[str]:
    return [a or b for a, b in PICTURE.findall(page.read_text())]


def test_the_picture_pattern_finds_both_spellings() -> None:
    text = '![a](../assets/x.png) and ![b](<y.png> "t") and <img alt="c" src="assets/w.png" width="40">'
    assert [a or b for a, b in PICTURE.findall(text)] == ["../assets/x.png", "y.png", "assets/w.png"]


def test_every_picture_a_page_shows_exists() -> None:
    missing = []
    for page in pages():
        for ref in pictures(page):
            if ref.startswith(("http://", "https://", "data:")):
                continue
            if not (page.parent / ref.split("#")[0]).resolve().is_file():
                missing.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not missing, missing


def test_every_picture_figures_makes_is_a_png_in_the_assets() -> None:
    script = (ROOT / "benchmarks" / "figures.py").read_text()
    names = set(re.findall(r"([a-z_]+\.png)", script.split('"""')[1]))  # the docstring lists what it writes
    names = {n for n in names if n not in {"rollout.png", "filters.png", "pos_embed_similarity.png",
                                           "mean_attention_distance.png"}}  # inspect's own names, copied as inspect_*
    assert {"drift.png", "batch_curve.png", "throughput_concurrency.png", "inspect_filters.png"} <= names
    for name in sorted(names):
        path = ROOT / "docs" / "assets" / name
        assert path.is_file(), f"{path.relative_to(ROOT)} missing: python benchmarks/figures.py"
        with Image.open(path) as im:
            assert im.format == "PNG" and min(im.size) >= 100, (name, im.format, im.size)
