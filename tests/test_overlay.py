"""vit_serve.overlay: colour maps (matplotlib is the reference), normalisation, blending, PNG encoding."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vit_serve.overlay import COLORMAPS, colormap, heatmap_image, normalize, overlay, to_png

REPO = Path(__file__).resolve().parents[1]


def test_jet_endpoints_and_ramps():
    assert colormap(np.array(0.0)).tolist() == [0, 0, 128]  # dark blue
    assert colormap(np.array(1.0)).tolist() == [128, 0, 0]  # dark red
    assert colormap(np.array(0.5)).tolist()[1] == 255  # green peaks in the middle
    v = np.linspace(0, 1, 513)
    c = colormap(v).astype(int)
    assert c.shape == (513, 3) and c.dtype == int
    r, g, b = c.T
    assert (np.diff(r[v <= 0.89]) >= 0).all() and r[v <= 0.35].max() == 0
    assert (np.diff(b[v >= 0.11]) <= 0).all() and b[v >= 0.65].max() == 0
    assert (np.diff(g[(v >= 0.125) & (v <= 0.375)]) >= 0).all()
    assert (np.diff(g[(v >= 0.64) & (v <= 0.91)]) <= 0).all()


@pytest.mark.parametrize("name", COLORMAPS)
def test_colormaps_match_matplotlib(name):
    matplotlib = pytest.importorskip("matplotlib")
    v = np.concatenate([np.linspace(0, 1, 2001), [0.0, 1.0, 1 / 256, 255 / 256]])
    ours = colormap(v, name).astype(np.float64) / 255
    ref = matplotlib.colormaps[name](v)[:, :3]
    assert np.abs(ours - ref).max() <= 1 / 255 + 1e-9


def test_colormap_shapes_clipping_and_unknown_name():
    assert colormap(np.zeros((2, 5, 7)), "inferno").shape == (2, 5, 7, 3)
    assert colormap(np.zeros((4, 4))).dtype == np.uint8
    np.testing.assert_array_equal(colormap(np.array([-3.0, np.nan])), colormap(np.array([0.0, 0.0])))
    np.testing.assert_array_equal(colormap(np.array([7.0])), colormap(np.array([1.0])))
    with pytest.raises(ValueError, match="jet, inferno"):
        colormap(np.zeros(3), "viridis")


def test_normalize():
    m = normalize(np.array([[2.0, 4.0], [6.0, 10.0]]))
    np.testing.assert_allclose(m, [[0.0, 0.25], [0.5, 1.0]])
    const = normalize(np.full((3, 5), 7.0))
    assert const.shape == (3, 5) and not const.any() and np.isfinite(const).all()
    t = normalize(torch.arange(6.0).reshape(1, 2, 3))  # torch and a leading batch of one are accepted
    assert t.shape == (2, 3) and t.min() == 0 and t.max() == 1
    assert normalize(np.array([[np.nan, 1.0], [3.0, np.inf]])).tolist() == [[0.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="2-D"):
        normalize(np.zeros((2, 3, 4)))


def _hot_corner() -> np.ndarray:
    m = np.zeros((4, 4))
    m[0, 0] = 1.0
    return m


def test_overlay_size_mode_and_where_it_colours():
    img = Image.new("RGB", (64, 48), (128, 128, 128))
    out = overlay(img, _hot_corner(), alpha=0.5)
    assert out.size == (64, 48) and out.mode == "RGB"
    a, base = np.asarray(out).astype(int), np.asarray(img).astype(int)
    hot, cold = a[4, 6], a[44, 60]  # inside patch (0, 0); far corner
    assert np.abs(hot - base[4, 6]).max() > 40
    assert hot[0] > hot[2] + 40  # red where the map is high (jet)
    assert cold[2] > cold[0] + 40  # blue where it is low
    # torch input gives the same picture
    np.testing.assert_array_equal(np.asarray(overlay(img, torch.tensor(_hot_corner()))), a)


def test_overlay_alpha_extremes():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    m = rng.random((2, 3))
    np.testing.assert_array_equal(np.asarray(overlay(img, m, alpha=0.0)), np.asarray(img))
    full = overlay(img, m, alpha=1.0, colormap="inferno")
    np.testing.assert_array_equal(np.asarray(full), np.asarray(heatmap_image(m, img.size, "inferno")))
    assert overlay(img.convert("L"), m).mode == "RGB"
    with pytest.raises(ValueError, match="alpha"):
        overlay(img, m, alpha=1.5)
    with pytest.raises(ValueError, match="unknown colormap"):
        overlay(img, m, colormap="nope")


def test_heatmap_image_sizes():
    m = np.arange(12.0).reshape(3, 4)
    assert heatmap_image(m).size == (4, 3)  # one pixel per patch
    big = heatmap_image(m, size=(80, 60))
    assert big.size == (80, 60) and big.mode == "RGB"
    a = np.asarray(heatmap_image(m))
    assert a[0, 0].tolist() == [0, 0, 128] and a[-1, -1].tolist() == [128, 0, 0]


def test_to_png_round_trips():
    img = overlay(Image.new("RGB", (40, 24), (10, 200, 30)), np.eye(3))
    data = to_png(img)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    back = Image.open(io.BytesIO(data))
    assert back.format == "PNG" and back.size == (40, 24)
    np.testing.assert_array_equal(np.asarray(back.convert("RGB")), np.asarray(img))


def test_import_does_not_pull_in_matplotlib():
    code = "import sys, vit_serve.overlay; print(sorted(m for m in sys.modules if m.startswith('matplotlib')))"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
