"""`vit-serve inspect`: the ViT paper's Figure 6 and 7 inspections as figures, plus every number behind them.

    result = inspect_model(model, ["cat.jpg", "dog.png"], "inspect_out")

writes into `inspect_out/`:

* ``filters.png`` (Figure 7 left): the top 28 principal components of the RGB patch-embedding filters
  (skipped, with the reason in the JSON, for hybrids, whose projection is a 1x1 conv over ResNet features);
* ``pos_embed_similarity.png`` (Figure 7 centre): cosine similarity of each position embedding to all others;
* ``mean_attention_distance.png`` (Figure 7 right): mean attention distance per head against depth;
* ``rollout.png`` (Figure 6) and one ``rollout_<name>.png`` per image: attention rollout over the input crop;
* ``registers.png`` (models with register tokens; Darcet et al. 2024, "Vision Transformers Need Registers",
  Figure 1): the last layer's head-mean attention of [class] and of each register over the patch grid;
* one ``tome_<name>.png`` per image with token merging (``tome=R``; Bolya et al. 2023, "Token Merging: Your ViT
  But Faster", Figure 4 and its reference's ``tome/vis.py``): the patches each final token holds, filled with
  their mean colour and outlined in one colour per token. The rollout then follows the merges; the mean
  attention distance and the register maps, which need every patch's own token, come from a pass without them;
* ``inspect.json``: the numbers of all of the above, the model's config and the settings used.

The math lives in :mod:`vit_serve.explain`, the colour overlays in :mod:`vit_serve.overlay`; this module only
lays them out. matplotlib (not a runtime dependency of the server) is needed here, and only here; figures are
drawn on Agg canvases through ``matplotlib.figure.Figure``, never through pyplot, so no global backend or
figure registry is touched and nothing is left open.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
from PIL import Image

from vit_serve import explain
from vit_serve.data import IMAGE_SUFFIXES, find_images
from vit_serve.overlay import overlay
from vit_serve.preprocess import PreprocessConfig, load_image, preprocess, resize_and_crop
from vit_serve.tome import TomeR, parse_r, tokens_after

try:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
except ImportError as e:  # pragma: no cover - matplotlib is in the [test] extra
    raise ImportError(f"vit_serve.inspect needs matplotlib (pip install matplotlib): {e}") from e

__all__ = [
    "IMAGE_SUFFIXES",
    "InspectResult",
    "check_out_dir",
    "check_settings",
    "default_images",
    "find_images",
    "inspect_model",
]

NUM_FILTER_COMPONENTS = 28  # the paper's Figure 7 left: 28 components in a 4 x 7 grid
MAX_SIMILARITY_PANELS = 16  # per side of the position-embedding figure
DPI = 120
OVERLAY_ALPHA = 0.5
OVERLAY_COLORMAP = "jet"

ImageInput = Image.Image | str | os.PathLike


# --------------------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------------------


def default_images() -> list[Path]:
    """The sample pictures matplotlib ships: grace_hopper.jpg first, then its other jpg/png files, sorted."""
    from matplotlib import cbook

    hopper = Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    others = sorted(p for p in hopper.parent.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p != hopper)
    return [hopper, *others]


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse an existing non-empty folder (FileExistsError) unless `overwrite`; refuse a file outright."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (CLI: --force) to write into it")
    return out


def check_settings(head_fusion: str, discard_ratio: float) -> None:
    """ValueError unless head_fusion is one of mean/max/min and 0 <= discard_ratio < 1 (rollout settings)."""
    if head_fusion not in explain.HEAD_FUSIONS:
        raise ValueError(f"unknown head_fusion {head_fusion!r}; expected one of {', '.join(explain.HEAD_FUSIONS)}")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}")


def _safe_stem(text: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "image"
    return stem[:64]


def _names(images: Sequence[ImageInput], names: Sequence[str] | None) -> list[str]:
    """Unique, file-name-safe names: the given ones, else each file's stem, else image<i>."""
    if names is not None and len(names) != len(images):
        raise ValueError(f"{len(names)} names for {len(images)} images")
    out: list[str] = []
    seen: set[str] = set()
    for i, im in enumerate(images):
        if names is not None:
            raw = str(names[i])
        elif isinstance(im, Image.Image):
            raw = Path(getattr(im, "filename", "") or f"image{i}").stem
        else:
            raw = Path(im).stem
        name, n = _safe_stem(raw), 2
        while name in seen:
            name, n = f"{_safe_stem(raw)}_{n}", n + 1
        seen.add(name)
        out.append(name)
    return out


def _preprocess_cfg(model: torch.nn.Module) -> PreprocessConfig:
    return getattr(model, "preprocess_cfg", None) or PreprocessConfig(input_size=model.cfg.img_size)


# --------------------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg)
# --------------------------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI, facecolor="white")


def _filters_figure(components: np.ndarray, ratios: np.ndarray, path: Path) -> None:
    """components [k, 3, P, P], ratios [k] -> a 4 x 7 grid of P x P RGB tiles, each min-max scaled."""
    rows, cols = 4, 7
    p = components.shape[-1]
    fig = _figure(cols * 1.3, rows * 1.45 + 0.5)
    axes = fig.subplots(rows, cols)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= len(components):
            continue
        tile = components[i].transpose(1, 2, 0)
        lo, hi = tile.min(), tile.max()
        tile = (tile - lo) / (hi - lo) if hi > lo else np.zeros_like(tile)
        ax.imshow(tile, interpolation="nearest")
        ax.set_title(f"PC{i + 1}: {100 * ratios[i]:.1f}%", fontsize=8)
    fig.suptitle(
        f"RGB embedding filters: top {len(components)} principal components ({p}×{p}, each tile "
        "min-max scaled; % = explained variance)",
        fontsize=10,
    )
    _save(fig, path)


def _subsample(n: int, limit: int) -> np.ndarray:
    """Indices of at most `limit` evenly spaced items of range(n), first and last included."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(int))


def _similarity_figure(sim: np.ndarray, path: Path) -> dict[str, list[int]]:
    """sim [gh, gw, gh, gw] -> one (gh, gw) similarity panel per shown position, in a grid laid out like the patches.

    Panels are drawn into one mosaic image (white gaps between them) with a shared colour bar over [-1, 1];
    big grids show evenly spaced rows/columns only. Returns the (0-based) rows and columns shown.
    """
    gh, gw = sim.shape[:2]
    rows, cols = _subsample(gh, MAX_SIMILARITY_PANELS), _subsample(gw, MAX_SIMILARITY_PANELS)
    pad = max(1, round(0.2 * max(gh, gw)))
    mosaic = np.full((len(rows) * (gh + pad) - pad, len(cols) * (gw + pad) - pad), np.nan)
    for a, i in enumerate(rows):
        for b, j in enumerate(cols):
            mosaic[a * (gh + pad) : a * (gh + pad) + gh, b * (gw + pad) : b * (gw + pad) + gw] = sim[i, j]
    h, w = mosaic.shape
    side = 7.0 if max(len(rows), len(cols)) <= 8 else 8.5
    width, height = (side, side * h / w) if w >= h else (side * w / h, side)
    fig = _figure(max(width, 4.0) + 1.4, max(height, 2.5) + 1.3)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1.0, vmax=1.0, interpolation="nearest")
    fs = 8 if max(len(rows), len(cols)) > 10 else 9
    ax.set_xticks([b * (gw + pad) + (gw - 1) / 2 for b in range(len(cols))], [str(j + 1) for j in cols], fontsize=fs)
    ax.set_yticks([a * (gh + pad) + (gh - 1) / 2 for a in range(len(rows))], [str(i + 1) for i in rows], fontsize=fs)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    title = f"Position embedding similarity ({gh}×{gw} patch grid)"
    if len(rows) < gh or len(cols) < gw:
        title += f"\nshowing {len(rows)} of {gh} rows × {len(cols)} of {gw} columns (evenly spaced)"
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, shrink=0.8, aspect=30, label="cosine similarity")
    _save(fig, path)
    return {"rows": rows.tolist(), "cols": cols.tolist()}


def _distance_figure(mad: np.ndarray, num_images: int, input_size: tuple[int, int], patch: int, path: Path) -> None:
    """mad [L, heads] in pixels -> scatter against depth 1..L, one colour per head."""
    layers, heads = mad.shape
    fig = _figure(7.2 if heads <= 16 else 6.2, 4.6)
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["tab20" if heads > 10 else "tab10"]
    depth = np.arange(1, layers + 1)
    for h in range(heads):
        ax.scatter(depth, mad[:, h], s=22, color=cmap(h % cmap.N), label=f"head {h + 1}", alpha=0.85, linewidths=0)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    step = max(1, math.ceil(layers / 24))
    ax.set_xticks(depth[::step])
    ax.set_xlim(0.5, layers + 0.5)
    ax.set_ylim(0, max(float(np.nanmax(mad)) * 1.1, 1.0))
    ax.grid(alpha=0.3)
    plural = "s" if num_images != 1 else ""
    ax.set_title(
        f"Mean attention distance per head ({input_size[0]}×{input_size[1]} input, patch {patch}, "
        f"{num_images} image{plural})",
        fontsize=10,
    )
    if heads <= 16:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    _save(fig, path)


def _short(text: str, n: int = 28) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _rollout_figure(
    crops: list[Image.Image], overlays: list[Image.Image], titles: list[tuple[str, str]], query: str, path: Path
) -> None:
    """Per image, the input crop and its rollout overlay side by side; up to 3 pairs per row; one colour bar."""
    n = len(crops)
    per_row = min(n, 3)
    nrows = math.ceil(n / per_row)
    w, h = crops[0].size
    panel_w = 2.8
    panel_h = panel_w * h / w + 0.55
    gap = 0.15  # a narrow empty column between pairs, so that each overlay stays next to its own image
    fig = _figure(per_row * (2 + gap) * panel_w + 1.0 - gap * panel_w, max(nrows * panel_h + 0.6, 3.6))
    ratios = ([1.0, 1.0, gap] * per_row)[:-1]
    axes = fig.subplots(nrows, len(ratios), squeeze=False, gridspec_kw={"width_ratios": ratios})
    for ax in axes.flat:
        ax.set_axis_off()
    for k in range(n):
        r, c = divmod(k, per_row)
        left, right = axes[r, 3 * c], axes[r, 3 * c + 1]
        left.imshow(np.asarray(crops[k]))
        left.set_title(titles[k][0], fontsize=8)
        right.imshow(np.asarray(overlays[k]))
        right.set_title(titles[k][1], fontsize=8)
    sm = ScalarMappable(norm=Normalize(0.0, 1.0), cmap=matplotlib.colormaps[OVERLAY_COLORMAP])
    fig.colorbar(sm, ax=axes, shrink=0.8 if nrows > 1 else 0.9, fraction=0.03, label="relevance (min-max per image)")
    what = {"cls": "the [class] token", "map-probe": "the attention-pool probe (MAP model)"}.get(
        query, "the mean of the patch tokens (GAP model)")
    fig.suptitle(f"Attention rollout over the model-input crop, read from {what}", fontsize=10)
    _save(fig, path)


# --------------------------------------------------------------------------------------------------------
# The inspection
# --------------------------------------------------------------------------------------------------------


def _top_k(logits: torch.Tensor, labels: Sequence[str] | None, k: int = 5) -> list[list[dict[str, Any]]]:
    """logits [B, K] -> per image the top-k {index, label, score (softmax probability)}."""
    probs = logits.float().softmax(dim=-1)
    scores, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)
    out = []
    for s_row, i_row in zip(scores.tolist(), idx.tolist(), strict=True):
        out.append(
            [
                {"index": i, "label": labels[i] if labels and i < len(labels) else f"class {i}", "score": s}
                for s, i in zip(s_row, i_row, strict=True)
            ]
        )
    return out


class InspectResult(TypedDict):
    """What :func:`inspect_model` returns and writes to ``inspect.json``, key by key in that order."""

    files: list[str]
    model: dict[str, Any]
    settings: dict[str, Any]
    filters: dict[str, Any]
    pos_embed_similarity: dict[str, Any]
    mean_attention_distance: dict[str, Any]
    rollout: dict[str, Any]
    registers: dict[str, Any]
    token_merging: dict[str, Any]


@dataclass
class _Pass:
    """Everything image-dependent, from one forward pass per batch."""

    crops: list[Image.Image]  # the model-input crops, as PIL images
    maps: list[torch.Tensor]  # per image the rollout map [gh, gw], float64
    tops: list[list[dict[str, Any]]]  # per image the top-5 (empty without a classifier head)
    mad_px: np.ndarray  # [L, heads] mean attention distance in pixels, averaged over the images
    query: str  # "cls", or "patch-mean" for GAP models
    registers: list[torch.Tensor]  # per image [len(tokens), gh, gw] (register models; else empty), float64
    tokens: list[str]  # the query tokens of `registers`: "class" (if any), then "reg1" .. "regR"
    groups: list[np.ndarray]  # token merging: per image [gh, gw], the final token holding each patch; else empty


def register_queries(cfg: Any) -> tuple[list[str], list[int]]:
    """(names, token indices) of the [class] token (if any) and each register, in timm's order
    [cls, dist, reg..., patches]; empty without registers."""
    if not cfg.reg_tokens:
        return [], []
    first = int(cfg.class_token) + int(cfg.dist_token)
    names = (["class"] if cfg.class_token else []) + [f"reg{r + 1}" for r in range(cfg.reg_tokens)]
    return names, ([0] if cfg.class_token else []) + list(range(first, first + cfg.reg_tokens))


def register_maps(last: torch.Tensor, rows: Sequence[int], grid: tuple[int, int], num_prefix_tokens: int
                  ) -> torch.Tensor:
    """The last layer's attention [B, heads, N, N] -> the head-mean rows `rows` over the patches [B, R, gh, gw]
    (raw probabilities: the prefix columns' share is left out, not renormalised)."""
    a = last.mean(dim=1)[:, list(rows), num_prefix_tokens:]
    return a.reshape(a.shape[0], len(rows), grid[0], grid[1])


def merge_groups(source: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """Token merging's sources [B, T, prefix + gh * gw] (`VisionTransformer.tome_source`: 1 where token t holds
    input token j) -> [B, gh, gw], the index of the token that holds each patch (as the reference's
    `make_visualization`: the argmax over the tokens)."""
    g = source[:, :, num_prefix_tokens:].argmax(dim=1)
    return g.reshape(source.shape[0], grid[0], grid[1])


def merge_groups_image(crop: Image.Image, groups: np.ndarray, seed: int = 0) -> Image.Image:
    """The ToMe paper's visualisation of merged tokens (its reference's `tome/vis.py` `make_visualization`):
    crop (the model-input crop, W x H) and groups [gh, gw] (`merge_groups`) -> an RGB image of the crop's size,
    each token's patches filled with their mean colour and its outline (the pixels that a 4-neighbour binary
    erosion removes, the image's edge included) drawn in the token's colour of a seeded random palette."""
    img = np.asarray(crop.convert("RGB"), dtype=np.float64) / 255.0
    h, w, _ = img.shape
    gh, gw = groups.shape
    labels = np.repeat(np.repeat(groups, h // gh, axis=0), w // gw, axis=1)
    count = int(groups.max()) + 1
    flat = labels.reshape(-1)
    size = np.bincount(flat, minlength=count)
    mean = np.stack([np.bincount(flat, img[..., c].reshape(-1), count) for c in range(3)], -1)
    mean = mean / np.maximum(size, 1)[:, None]
    pad = np.pad(labels, 1, constant_values=-1)
    interior = ((pad[1:-1, 1:-1] == pad[:-2, 1:-1]) & (pad[1:-1, 1:-1] == pad[2:, 1:-1])
                & (pad[1:-1, 1:-1] == pad[1:-1, :-2]) & (pad[1:-1, 1:-1] == pad[1:-1, 2:]))
    palette = np.random.default_rng(seed).random((count, 3))
    out = np.where(interior[..., None], mean[labels], palette[labels])
    return Image.fromarray(np.uint8(out * 255))


def _plain_attentions(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """model(x, return_attention=True)'s attentions (float32) with token merging off for the pass."""
    tm = model.token_merging
    model.token_merging = None
    try:
        return [a.float() for a in model(x, return_attention=True)[1]]
    finally:
        model.token_merging = tm


def _resolve_images(images: Sequence[ImageInput] | str | os.PathLike | None) -> list[ImageInput]:
    """None -> matplotlib's samples; a folder -> its image files; else the given images (ValueError if none)."""
    if images is None:
        images = default_images()
    elif isinstance(images, (str, os.PathLike)):
        images = find_images(images)
    images = list(images)
    if not images:
        raise ValueError("no images to inspect")
    return images


def _forward(
    model: torch.nn.Module,
    decoded: list[Image.Image],
    pcfg: PreprocessConfig,
    head_fusion: str,
    discard_ratio: float,
    batch_size: int,
) -> _Pass:
    """Run `model` (in eval mode, its mode restored after) over `decoded` in batches of `batch_size`."""
    cfg, prefix = model.cfg, model.num_prefix_tokens
    grid = model.check_size(*pcfg.input_size)
    param = next(model.parameters())
    maps: list[torch.Tensor] = []
    tops: list[list[dict[str, Any]]] = []
    mad_sum = None
    query = "cls"
    tokens, rows = register_queries(cfg)
    registers: list[torch.Tensor] = []
    groups: list[np.ndarray] = []
    merging = model.token_merging is not None
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(decoded), batch_size):
            chunk = decoded[start : start + batch_size]
            x = torch.stack([preprocess(im, pcfg) for im in chunk]).to(param.device, param.dtype)
            e = explain.explain_forward(model, x, head_fusion, discard_ratio)
            logits, attentions = e.logits, e.attentions
            query = e.heatmap.query
            maps.extend(e.heatmap.map.double().cpu())
            if merging:
                groups.extend(merge_groups(model.tome_source, grid, prefix).cpu().numpy())
                attentions = _plain_attentions(model, x)
            encoder = explain.split_probe(attentions, cfg.pool)[0]  # a MAP model's probe is not a layer
            mad = explain.mean_attention_distance(encoder, grid, cfg.patch_size, prefix) * len(chunk)
            mad_sum = mad if mad_sum is None else mad_sum + mad
            if rows:
                registers.extend(register_maps(encoder[-1], rows, grid, prefix).double().cpu())
            tops.extend(_top_k(logits, model.labels) if cfg.num_classes else [[] for _ in chunk])
    finally:
        model.train(was_training)
    crops = [resize_and_crop(im, pcfg) for im in decoded]
    return _Pass(crops, maps, tops, (mad_sum / len(decoded)).numpy(), query, registers, tokens, groups)


def _model_section(model: torch.nn.Module, pcfg: PreprocessConfig) -> dict[str, Any]:
    return {
        "config": model.cfg.to_dict(),
        "preprocess": pcfg.to_dict(),
        "num_prefix_tokens": model.num_prefix_tokens,
        "input_grid": list(model.check_size(*pcfg.input_size)),
        "pos_embed_grid": list(model.grid_size),
        "has_labels": bool(getattr(model, "labels", None)),
    }


def _settings_section(head_fusion: str, discard_ratio: float, num_images: int) -> dict[str, Any]:
    return {
        "head_fusion": head_fusion,
        "discard_ratio": discard_ratio,
        "num_images": num_images,
        "overlay": {"alpha": OVERLAY_ALPHA, "colormap": OVERLAY_COLORMAP},
        "filter_components": NUM_FILTER_COMPONENTS,
    }


def _filters_skip_reason(model: torch.nn.Module, weight: torch.Tensor) -> str | None:
    """Why the patch-embedding weight [D, C, P, P] is not RGB filters (None when it is)."""
    if model.cfg.resnet_layers is not None:
        return "hybrid model: the patch embedding is a 1x1 projection of ResNet features, not filters over RGB pixels"
    if weight.shape[1] != 3:
        return f"the patch embedding has {weight.shape[1]} input channels, not RGB"
    return None


def _write_filters(model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """Figure 7 left (``filters.png``), or the reason it is skipped."""
    weight = model.patch_embed.proj.weight.detach().cpu()
    skip = _filters_skip_reason(model, weight)
    if skip is not None:
        return {"skipped": skip}
    comps, ratios = explain.filter_pca(weight, NUM_FILTER_COMPONENTS)
    _filters_figure(comps.numpy(), ratios.numpy(), out / "filters.png")
    return {
        "file": "filters.png",
        "filter_shape": list(weight.shape[1:]),
        "num_components": len(ratios),
        "explained_variance_ratio": ratios.tolist(),
    }


def _write_similarity(model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """Figure 7 centre (``pos_embed_similarity.png``): [gh, gw, gh, gw] cosine similarities; skipped, with the
    reason, for a model without absolute position embeddings (RoPE only: DINOv3, RoPE-ViT)."""
    if model.pos_embed is None:
        return {"skipped": "the model has no absolute position embeddings: its rotary ones (RoPE) rotate q and k "
                           "by the patch coordinates and have no per-position vector to compare"}
    pos = model.pos_embed.detach().cpu()
    # no_embed_class models (DINOv2 with registers) have no position embeddings for the prefix tokens
    sim = explain.pos_embed_similarity(pos, model.grid_size, model.cfg.num_pos_prefix_tokens).numpy()
    shown = _similarity_figure(sim, out / "pos_embed_similarity.png")
    return {
        "file": "pos_embed_similarity.png",
        "grid": list(model.grid_size),
        "measure": "cosine",
        "panels_shown": shown,
        "similarity": np.round(sim, 6).tolist(),
        **({"note": "the model also rotates q and k (RoPE): these are its absolute embeddings only"}
           if model.rope is not None else {}),
    }


def _write_distance(mad_px: np.ndarray, num_images: int, pcfg: PreprocessConfig, patch: int, out: Path
                    ) -> dict[str, Any]:
    """Figure 7 right (``mean_attention_distance.png``) from mad_px [L, heads] in pixels."""
    _distance_figure(mad_px, num_images, pcfg.input_size, patch, out / "mean_attention_distance.png")
    return {
        "file": "mean_attention_distance.png",
        "unit": "pixels",
        "shape": list(mad_px.shape),
        "input_size": list(pcfg.input_size),
        "patch_size": patch,
        "num_images": num_images,
        "values": mad_px.tolist(),
    }


def _source(src: ImageInput) -> str | None:
    return str(src) if isinstance(src, (str, os.PathLike)) else getattr(src, "filename", "") or None


def _titles(name: str, crop: Image.Image, top: list[dict[str, Any]]) -> tuple[str, str]:
    """The (input, overlay) panel titles of one image in ``rollout.png``."""
    top1 = f"top-1: {_short(top[0]['label'])} ({100 * top[0]['score']:.1f}%)" if top else "no classifier head"
    return f"{_short(name)} ({crop.width}×{crop.height})", top1


def _write_rollout(
    images: list[ImageInput], names: list[str], seen: _Pass, head_fusion: str, discard_ratio: float, out: Path
) -> dict[str, Any]:
    """Figure 6: one ``rollout_<name>.png`` overlay per image, then ``rollout.png`` with them all."""
    overlays = [overlay(c, m, OVERLAY_ALPHA, OVERLAY_COLORMAP) for c, m in zip(seen.crops, seen.maps, strict=True)]
    per_image = []
    for src, name, ov, m, top in zip(images, names, overlays, seen.maps, seen.tops, strict=True):
        file = f"rollout_{name}.png"
        ov.save(out / file)
        per_image.append(
            {
                "name": name,
                "source": _source(src),
                "file": file,
                "query": seen.query,
                "grid": list(m.shape),
                "map": m.tolist(),
                "top5": top,
            }
        )
    titles = [_titles(n, c, t) for n, c, t in zip(names, seen.crops, seen.tops, strict=True)]
    _rollout_figure(seen.crops, overlays, titles, seen.query, out / "rollout.png")
    return {
        "file": "rollout.png",
        "query": seen.query,
        "head_fusion": head_fusion,
        "discard_ratio": discard_ratio,
        "images": per_image,
    }


def _registers_figure(crops: list[Image.Image], maps: list[np.ndarray], names: list[str], tokens: list[str],
                      path: Path) -> None:
    """Per image (a row): the input crop, then each query token's map [gh, gw] (one cell per patch), min-max per
    panel, as in Darcet et al.'s Figure 1."""
    cols = 1 + len(tokens)
    w, h = crops[0].size
    fig = _figure(cols * 1.6 + 0.8, len(crops) * (1.6 * h / w + 0.35) + 0.6)
    axes = fig.subplots(len(crops), cols, squeeze=False)
    for r, (crop, m, name) in enumerate(zip(crops, maps, names, strict=True)):
        axes[r, 0].imshow(np.asarray(crop))
        axes[r, 0].set_title(_short(name, 18), fontsize=8)
        for c, token in enumerate(tokens):
            axes[r, c + 1].imshow(m[c], cmap="viridis", interpolation="nearest")  # one cell per patch
            axes[r, c + 1].set_title(f"[{token}]", fontsize=8)
    for ax in axes.flat:
        ax.set_axis_off()
    sm = ScalarMappable(norm=Normalize(0.0, 1.0), cmap=matplotlib.colormaps["viridis"])
    fig.colorbar(sm, ax=axes, shrink=0.8, fraction=0.03, label="attention (min-max per map)")
    fig.suptitle("Last layer's attention over the patches (mean over heads): [class] and registers", fontsize=10)
    _save(fig, path)


def _write_registers(names: list[str], seen: _Pass, layer: int, out: Path) -> dict[str, Any]:
    """``registers.png`` and its maps (register models), or the reason it is skipped."""
    if not seen.registers:
        return {"skipped": "the model has no register tokens"}
    maps = [m.numpy() for m in seen.registers]
    _registers_figure(seen.crops, maps, names, seen.tokens, out / "registers.png")
    return {
        "file": "registers.png",
        "layer": layer,
        "head_fusion": "mean",
        "tokens": seen.tokens,
        "images": [{"name": n, "grid": list(m.shape[1:]), "maps": m.tolist()}
                   for n, m in zip(names, maps, strict=True)],
    }


def _write_tome(model: torch.nn.Module, r: Any, names: list[str], seen: _Pass, pcfg: PreprocessConfig, out: Path
                ) -> dict[str, Any]:
    """One ``tome_<name>.png`` per image and the merge groups (token merging on), or the reason there are none.
    r: as asked for (None: the model's own setting, recorded as its schedule)."""
    tm = model.token_merging
    if tm is None:
        return {"skipped": "token merging is off (CLI: --tome R)"}
    grid = model.check_size(*pcfg.input_size)
    per_image = []
    for name, crop, g in zip(names, seen.crops, seen.groups, strict=True):
        file = f"tome_{name}.png"
        merge_groups_image(crop, g).save(out / file)
        per_image.append({"name": name, "file": file, "tokens": len(np.unique(g)), "groups": g.tolist()})
    return {
        "r": list(tm.r) if r is None else r,
        "schedule": list(tm.r),
        "prop_attn": tm.prop_attn,
        "tokens": tokens_after(model.num_prefix_tokens + grid[0] * grid[1], list(tm.r), model.num_prefix_tokens),
        "unmerged": ["mean_attention_distance", "registers"],
        "images": per_image,
    }


@torch.no_grad()
def inspect_model(
    model: torch.nn.Module,
    images: Sequence[ImageInput] | str | os.PathLike | None,
    out_dir: str | os.PathLike,
    head_fusion: str = explain.DEFAULT_HEAD_FUSION,
    discard_ratio: float = explain.DEFAULT_DISCARD_RATIO,
    names: Sequence[str] | None = None,
    overwrite: bool = False,
    batch_size: int = 8,
    tome: TomeR | None = None,
) -> InspectResult:
    """Run the paper's Figure 6/7 inspections of `model` on `images` and write figures + ``inspect.json``.

    Args:
        model: a VisionTransformer (e.g. from ``vit_serve.load``); run in eval mode here, its mode restored after.
        images: PIL images and/or image paths; a folder (its image files, see :func:`find_images`); or None for
            matplotlib's sample pictures (:func:`default_images`). Each is preprocessed with the model's
            ``preprocess_cfg`` (``vit_serve.preprocess``); the overlays are drawn on the same crop
            (``resize_and_crop``), so maps and pixels align.
        out_dir: created if needed; an existing non-empty folder is refused (FileExistsError) unless
            `overwrite` (files are then replaced, other files left alone).
        head_fusion, discard_ratio: attention-rollout settings (:func:`vit_serve.explain.rollout`).
        names: one name per image for titles and ``rollout_<name>.png`` (default: file stems, image<i>).
        batch_size: images per forward pass; all attentions come from one ``model(x, return_attention=True)``
            pass per batch, under no_grad.
        tome: token merging for the inspection (`VisionTransformer.set_token_merging`'s r: an int, one per
            layer, or (r, inflection); 0: off; None: the model's own setting), restored after: the rollout
            follows the merges and ``tome_<name>.png`` shows them; a bad r is a ValueError before anything is
            written.

    Returns the dict written to ``inspect.json`` (:class:`InspectResult`): ``files`` (names inside out_dir),
    ``model`` (config, preprocessing, grids), ``settings``, ``filters`` (explained-variance ratios, or
    ``skipped`` with the reason), ``pos_embed_similarity`` ([gh, gw, gh, gw] nested lists, or ``skipped``
    without absolute position embeddings),
    ``mean_attention_distance`` ([L, heads] in pixels, averaged over the images) and ``rollout`` (per image:
    name, source path, the raw [gh, gw] map, its ``query`` ("cls", or "patch-mean" for GAP models) and the
    top-5 labels and softmax scores) and ``registers`` (models with register tokens: per image the last layer's
    head-mean attention [1 + R, gh, gw] of [class] and each register over the patches, raw probabilities; else
    ``skipped`` with the reason) and ``token_merging`` (with token merging: r as given, the schedule per layer,
    the token count entering each layer and after the last, and per image the [gh, gw] index of the final token
    holding each patch; else ``skipped``).
    """
    check_settings(head_fusion, discard_ratio)
    if tome is not None:
        parse_r(len(model.blocks), tome)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = check_out_dir(out_dir, overwrite)
    images = _resolve_images(images)
    image_names = _names(images, names)
    pcfg = _preprocess_cfg(model)
    model.check_size(*pcfg.input_size)
    decoded = [load_image(im) for im in images]
    prior = model.token_merging, model.tome_source
    try:
        if tome is not None:
            model.set_token_merging(tome, trace_source=True)
        elif model.token_merging is not None:  # the model's own merging, traced for the figure
            model.token_merging = dataclasses.replace(model.token_merging, trace_source=True)
        seen = _forward(model, decoded, pcfg, head_fusion, discard_ratio, batch_size)
        out.mkdir(parents=True, exist_ok=True)
        merged = _write_tome(model, tome, image_names, seen, pcfg, out)
    finally:
        model.token_merging, model.tome_source = prior

    filters = _write_filters(model, out)
    similarity = _write_similarity(model, out)
    distance = _write_distance(seen.mad_px, len(decoded), pcfg, model.cfg.patch_size, out)
    rollout = _write_rollout(images, image_names, seen, head_fusion, discard_ratio, out)
    registers = _write_registers(image_names, seen, model.cfg.depth, out)
    files = [
        *([filters["file"]] if "file" in filters else []),
        *([similarity["file"]] if "file" in similarity else []),
        "mean_attention_distance.png",
        rollout["file"],
        *(im["file"] for im in rollout["images"]),
        *([registers["file"]] if "file" in registers else []),
        *(im["file"] for im in merged.get("images", [])),
        "inspect.json",
    ]
    result = InspectResult(
        files=files,
        model=_model_section(model, pcfg),
        settings=_settings_section(head_fusion, discard_ratio, len(decoded)),
        filters=filters,
        pos_embed_similarity=similarity,
        mean_attention_distance=distance,
        rollout=rollout,
        registers=registers,
        token_merging=merged,
    )
    (out / "inspect.json").write_text(json.dumps(result, default=str) + "\n")
    return result
