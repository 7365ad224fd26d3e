"""Zero-shot heads from label text (CLIP, SigLIP): open_clip's zero_shot_classifier recipe.

    w_c = normalize(mean_t normalize(text_embedding(template_t(label_c))))        [C, E]
    logits = logit_scale.exp() * normalize(image_embedding) @ W^T (+ logit_bias)   [B, C]

softmax scores for CLIP, one sigmoid per label for SigLIP (its logit bias). The result is an ordinary
classifier: head weight = logit_scale.exp() * W, head bias = logit_bias (or 0), `cfg.embed_norm=True`
(the model L2-normalises its embedding before the head), `cfg.scores`, and `labels` set.
Reference: open_clip.zero_shot_classifier.build_zero_shot_classifier and CLIP.get_logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vit_serve.model import VisionTransformer
from vit_serve.text.bundle import TextBundle

DEFAULT_TEMPLATES = ("a photo of a {}.",)
MAX_LABEL_CHARS = 1000


class ZeroShotError(ValueError):
    """Labels, templates or a model that cannot make a zero-shot head (the CLI exits 2, nothing written)."""

    exit_code = 2


def _scale(logit_scale: float) -> torch.Tensor:
    """exp of the log scale in float32, as open_clip's `logit_scale.exp()`."""
    return torch.tensor(logit_scale, dtype=torch.float32).exp()


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


def prompts(labels: Sequence[str], templates: Sequence[str]) -> list[str]:
    """C labels x T templates -> C*T prompts, label-major (label 0's T prompts first)."""
    return [t.replace("{}", label) for label in labels for t in templates]


def class_embeddings(text_embeddings: torch.Tensor) -> torch.Tensor:
    """[C, T, E] prompt embeddings -> [C, E]: mean of the L2-normalised prompts, renormalised (open_clip)."""
    return F.normalize(F.normalize(text_embeddings, dim=-1).mean(dim=1), dim=-1)


def zero_shot_logits(image_embeddings: torch.Tensor, weights: torch.Tensor, logit_scale: float,
                     logit_bias: float | None = None) -> torch.Tensor:
    """[B, E] image embeddings, [C, E] class embeddings -> [B, C] logits: exp(scale) * cos (+ bias)."""
    logits = _scale(logit_scale) * F.normalize(image_embeddings, dim=-1) @ weights.t()
    return logits + logit_bias if logit_bias is not None else logits


@torch.no_grad()
def label_weights(bundle: TextBundle, labels: Sequence[str], templates: Sequence[str] = DEFAULT_TEMPLATES,
                  batch_size: int = 256) -> torch.Tensor:
    """The class embeddings [C, E] of `labels` with the text tower (templates filled with each label)."""
    labels, templates = check_labels(labels), check_templates(templates)
    texts = prompts(labels, templates)
    emb = torch.cat([bundle.encode(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)])
    return class_embeddings(emb.reshape(len(labels), len(templates), -1).float())


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
    ref = model.pos_embed
    model.head.weight.copy_((_scale(bundle.logit_scale) * w).to(ref))
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
