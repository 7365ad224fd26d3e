"""Zero-shot heads from label text (CLIP, SigLIP): open_clip's zero_shot_classifier recipe, the one copy of it.

    w_c = normalize(mean_t normalize(text_embedding(template_t(label_c))))        [C, E]
    logits = logit_scale.exp() * normalize(image_embedding) @ W^T (+ logit_bias)   [B, C]

softmax scores for CLIP, one sigmoid per label for SigLIP (its logit bias). Both places that use it stand on the
functions here: a head built once from labels (`zero_shot_classifier`, torch: `vit-serve convert --zero-shot`)
and labels given at request time (`vit_serve.runtime.zero_shot` and the text tower, numpy). The math is numpy
(`prompts`, `class_embeddings`, `logit_multiplier`, `label_logits`); the head is an ordinary classifier: head
weight = logit_multiplier * W, head bias = logit_bias (or 0), `cfg.embed_norm=True` (the model L2-normalises its
embedding before the head), `cfg.scores`, and `labels` set.
Reference: open_clip.zero_shot_classifier.build_zero_shot_classifier and CLIP.get_logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vit_serve.embedding import l2_normalize
from vit_serve.text.manifest import DEFAULT_TEMPLATES

if TYPE_CHECKING:
    from vit_serve.model import VisionTransformer
    from vit_serve.text.bundle import TextBundle

__all__ = ["DEFAULT_TEMPLATES", "MAX_LABEL_CHARS", "ZeroShotError", "check_labels", "check_templates",
           "class_embeddings", "label_logits", "label_weights", "logit_multiplier", "prompts", "read_lines",
           "zero_shot_classifier"]

MAX_LABEL_CHARS = 1000


class ZeroShotError(ValueError):
    """Labels, templates or a model that cannot make a zero-shot head (the CLI exits 2, nothing written)."""

    exit_code = 2


def check_labels(labels: Sequence[str]) -> list[str]:
    """Stripped, non-empty, unique labels (ZeroShotError otherwise)."""
    out = [str(label).strip() for label in labels]
    if not out:
        raise ZeroShotError("no labels given for the zero-shot head")
    for label in out:
        if not label or len(label) > MAX_LABEL_CHARS:
            raise ZeroShotError(f"bad label {label!r}: labels must be 1-{MAX_LABEL_CHARS} characters")
    dupes = sorted({label for label in out if out.count(label) > 1})
    if dupes:
        raise ZeroShotError(f"duplicate labels: {', '.join(dupes[:5])}")
    return out


def check_templates(templates: Sequence[str]) -> list[str]:
    """Templates that each hold one "{}" (where the label goes)."""
    out = [str(t).strip() for t in templates]
    if not out:
        raise ZeroShotError("no templates given for the zero-shot head")
    for t in out:
        if t.count("{}") != 1:
            raise ZeroShotError(f"bad template {t!r}: each template needs exactly one {{}} for the label")
    return out


# ---- the recipe ------------------------------------------------------------------------------------------------

def prompts(labels: Sequence[str], templates: Sequence[str]) -> list[str]:
    """C labels x T templates -> C*T prompts, label-major: [t0(l0), t1(l0), ..., t0(l1), ...]."""
    return [t.replace("{}", label) for label in labels for t in templates]


def class_embeddings(prompt_embeds: np.ndarray, num_templates: int) -> np.ndarray:
    """Text embeddings [C * T, E] of C labels' T prompts (label-major, as `prompts`) -> class embeddings [C, E]
    float32: each label's L2-normalised prompt embeddings averaged and normalised again (open_clip)."""
    e = l2_normalize(np.asarray(prompt_embeds, np.float32))
    return l2_normalize(e.reshape(-1, num_templates, e.shape[-1]).mean(axis=1))


def logit_multiplier(logit_scale: float) -> np.float32:
    """exp of the log scale (open_clip's `logit_scale.exp()`), float32: what the cosines are multiplied by."""
    return np.float32(math.exp(logit_scale))


def label_logits(image_embeds: np.ndarray, classes: np.ndarray, logit_scale: float,
                 logit_bias: float | None) -> np.ndarray:
    """Image embeddings [B, E] (not normalised) and class embeddings [C, E] (normalised) -> logits [B, C] float32:
    exp(scale) * cos (+ bias)."""
    img = l2_normalize(np.asarray(image_embeds, np.float32))
    logits = (img @ classes.T) * logit_multiplier(logit_scale)
    if logit_bias is not None:
        logits = logits + np.float32(logit_bias)
    return logits.astype(np.float32, copy=False)


# ---- a head built from labels (torch) --------------------------------------------------------------------------

@torch.no_grad()
def label_weights(bundle: TextBundle, labels: Sequence[str], templates: Sequence[str] = DEFAULT_TEMPLATES,
                  batch_size: int = 256) -> torch.Tensor:
    """The class embeddings [C, E] float32 of `labels` with the text tower (templates filled with each label),
    the prompts of about `batch_size` // T labels encoded at a time."""
    labels, templates = check_labels(labels), check_templates(templates)
    step = max(1, batch_size // len(templates))
    rows = [class_embeddings(bundle.encode(prompts(labels[i:i + step], templates)).float().cpu().numpy(),
                             len(templates)) for i in range(0, len(labels), step)]
    return torch.from_numpy(np.concatenate(rows))


@torch.no_grad()
def zero_shot_classifier(model: VisionTransformer, bundle: TextBundle, labels: Sequence[str],
                         templates: Sequence[str] = DEFAULT_TEMPLATES) -> VisionTransformer:
    """`model` with a zero-shot head for `labels` (in place, returned): weight exp(scale) * W, bias
    logit_bias or 0, embed_norm, scores "sigmoid" for SigLIP (a logit bias) else "softmax", labels set. The
    bundle keeps `templates` (`TextBundle.templates`): saved with it, they become its exported text tower's, so
    that labels given at request time are prompted as the head's were."""
    labels = check_labels(labels)
    if model.cfg.dist_token:
        raise ZeroShotError("a zero-shot head needs a model without a distillation token")
    w = label_weights(bundle, labels, templates)
    if w.shape[1] != model.cfg.embed_dim_out:
        raise ZeroShotError(f"the text tower's embeddings ({w.shape[1]}) do not match the image embedding "
                            f"({model.cfg.embed_dim_out})")
    model.reset_head(len(labels), keep_pre_logits=True)
    ref = model.patch_embed.proj.weight  # its device and dtype (RoPE models have no pos_embed)
    model.head.weight.copy_((w * float(logit_multiplier(bundle.logit_scale))).to(ref))
    model.head.bias.fill_(bundle.logit_bias if bundle.logit_bias is not None else 0.0)
    model.cfg = model.cfg.replace(embed_norm=True, scores="sigmoid" if bundle.sigmoid else "softmax")
    model.labels = labels
    bundle.templates = tuple(check_templates(templates))
    return model


def read_lines(path: str, what: str) -> list[str]:
    """Non-empty lines of a UTF-8 text file (labels, templates); ZeroShotError when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ZeroShotError(f"cannot read the {what} file {path}: {' '.join(str(e).split())}") from None
