"""Make docs/assets/hero.png: a sample scan, its attention-rollout overlay and its top-5, from the quickstart.

    python docs/make_hero.py [--run runs/quickstart] [--image digit_3.png] [--out docs/assets/hero.png]

Runs `vit-serve quickstart --no-serve` first when the run folder holds no fine-tuned model yet (a few minutes on
a CPU; a finished run is reused). The picture is what the served model answers: the quickstart's fine-tuned
32x32 digits ViT, the rollout `vit_serve.explain.explain_forward` computes (the map `GET /explain` draws) and
the softmax top-5 `POST /classify` returns, drawn with `vit_serve.overlay`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

import vit_serve
from vit_serve.explain import explain_forward
from vit_serve.overlay import overlay
from vit_serve.preprocess import load_image, resize_and_crop
from vit_serve.quickstart import QuickstartPaths

PANEL = 256
BAR_W = 300


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one bitmap size
        return ImageFont.load_default()


def ensure_run(run: Path) -> Path:
    """The fine-tuned checkpoint of a quickstart run in `run`, running the quickstart when it is missing."""
    ckpt = QuickstartPaths(run).finetune / "model.safetensors"
    if not ckpt.exists():
        subprocess.run([sys.executable, "-m", "vit_serve", "quickstart", "--out", str(run), "--no-serve"], check=True)
    return ckpt


def top5_panel(preds: list[tuple[str, float]], height: int) -> Image.Image:
    """Horizontal bars, best first, as the web page draws them."""
    img = Image.new("RGB", (BAR_W, height), "white")
    draw = ImageDraw.Draw(img)
    font, small = _font(18), _font(14)
    draw.text((12, 8), "top-5 (softmax)", fill="black", font=font)
    row = (height - 40) // len(preds)
    for i, (label, score) in enumerate(preds):
        y = 40 + i * row
        draw.text((12, y + 6), label, fill="black", font=font)
        draw.rectangle((48, y + 4, 48 + int((BAR_W - 120) * score), y + row - 10),
                       fill="#1f77b4" if i == 0 else "#9ecae1")
        draw.text((BAR_W - 64, y + 8), f"{score:.3f}", fill="black", font=small)
    return img


def make(run: Path, image: str, out: Path) -> list[tuple[str, float]]:
    """Write the picture; returns the top-5 it shows."""
    model = vit_serve.load(ensure_run(run))
    path = QuickstartPaths(run).samples / image
    crop = resize_and_crop(load_image(path), model.preprocess_cfg)  # the model-input crop (32x32)
    x = vit_serve.preprocess(path, model.preprocess_cfg)[None]
    with torch.no_grad():
        e = explain_forward(model, x)
    scores = e.logits.softmax(-1)[0]
    best = scores.topk(5)
    preds = [(model.labels[i], float(s)) for s, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)]

    shown = crop.convert("RGB").resize((PANEL, PANEL), Image.Resampling.NEAREST)
    panels = [shown, overlay(shown, e.heatmap.map[0].numpy(), alpha=0.5), top5_panel(preds, PANEL)]
    hero = Image.new("RGB", (sum(p.width for p in panels) + 16 * (len(panels) + 1), PANEL + 32), "white")
    x0 = 16
    for p in panels:
        hero.paste(p, (x0, 16))
        x0 += p.width + 16
    out.parent.mkdir(parents=True, exist_ok=True)
    hero.save(out, optimize=True)
    return preds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/quickstart"))
    ap.add_argument("--image", default="digit_3.png", help="a sample scan the quickstart wrote")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "assets" / "hero.png")
    args = ap.parse_args(argv)
    preds = make(args.run, args.image, args.out)
    print(f"{args.out}: " + ", ".join(f"{label} {score:.3f}" for label, score in preds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
