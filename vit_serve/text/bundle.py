"""TextBundle: a text tower, its tokenizer and the contrastive logit scale / bias; and how our checkpoint
carries it (tensors under `text.`, metadata keys `text_*`, both ignored by the image-model loader)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vit_serve.checkpoints.converted import CheckpointError, one_line
from vit_serve.checkpoints.io import TEXT_PREFIX
from vit_serve.text.tokenizer import Tokenizer, spec_to_json, tokenizer_from_spec
from vit_serve.text.tower import TextConfig, TextTransformer

META_CONFIG = "text_config"
META_TOKENIZER = "text_tokenizer"
META_SCALE = "text_logit_scale"
META_BIAS = "text_logit_bias"
META_TEMPLATES = "text_templates"  # the prompt templates a zero-shot head was built with (convert --templates)


@dataclass
class TextBundle:
    """A text tower with its tokenizer. `logit_scale` is the stored log-scale (logits use exp of it, as
    open_clip's `logit_scale.exp()`); `logit_bias` is SigLIP's (None for CLIP: softmax scores); `templates` the
    prompt templates of the zero-shot head built with it (`zeroshot.zero_shot_classifier`), which travel with it
    into the checkpoint and the exported text tower's manifest."""

    tower: TextTransformer
    tokenizer: Tokenizer
    logit_scale: float
    logit_bias: float | None = None
    templates: tuple[str, ...] | None = None  # the prompt templates its zero-shot head was built with, if any

    @property
    def config(self) -> TextConfig:
        return self.tower.cfg

    @property
    def sigmoid(self) -> bool:
        """SigLIP-style scores (a logit bias, one sigmoid per label) rather than a softmax over labels."""
        return self.logit_bias is not None

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        """K strings -> token ids LongTensor [K, L]."""
        return self.tokenizer(list(texts))

    @torch.no_grad()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """K strings -> unnormalised text embeddings [K, E] (open_clip encode_text / HF get_text_features)."""
        p = next(self.tower.parameters())
        return self.tower.eval()(self.tokenize(texts).to(p.device))


def text_payload(bundle: TextBundle) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors named `text.*`, metadata `text_*`) to store beside an image model (checkpoints.io.save)."""
    tensors = {TEXT_PREFIX + k: v for k, v in bundle.tower.state_dict().items()}
    meta = {META_CONFIG: bundle.config.to_json(), META_TOKENIZER: spec_to_json(bundle.tokenizer.to_spec()),
            META_SCALE: json.dumps(bundle.logit_scale), META_BIAS: json.dumps(bundle.logit_bias)}
    if bundle.templates is not None:
        meta[META_TEMPLATES] = json.dumps(list(bundle.templates))
    return tensors, meta


def bundle_from_state(cfg: TextConfig, state: Mapping[str, torch.Tensor], tokenizer: Tokenizer, logit_scale: float,
                      logit_bias: float | None, source: str) -> TextBundle:
    """A ready (eval, fp32) tower from our-named weights; CheckpointError on missing / extra / mis-shaped keys."""
    from vit_serve.checkpoints.converted import check_state_dict

    with torch.device("meta"):
        tower = TextTransformer(cfg)
    sd = {k: v.to(torch.float32).contiguous() if v.is_floating_point() else v for k, v in state.items()}
    check_state_dict(tower, sd, source)
    tower.load_state_dict(sd, assign=True)
    mask = torch.full((cfg.context_length, cfg.context_length), float("-inf")).triu_(1)
    tower.attn_mask = mask if cfg.causal else None  # buffers are not in the state dict: rebuild off meta
    return TextBundle(tower.eval(), tokenizer, float(logit_scale), None if logit_bias is None else float(logit_bias))


def bundle_from_checkpoint(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str],
                           source: str) -> TextBundle | None:
    """The text tower stored in our checkpoint (None when it has none)."""
    if META_CONFIG not in meta:
        return None
    try:
        cfg = TextConfig.from_dict(json.loads(meta[META_CONFIG]))
        tok = tokenizer_from_spec(json.loads(meta[META_TOKENIZER]))
        scale = json.loads(meta[META_SCALE])
        bias = json.loads(meta.get(META_BIAS, "null"))
        templates = json.loads(meta.get(META_TEMPLATES, "null"))
        if templates is not None and not (isinstance(templates, list) and templates
                                          and all(isinstance(t, str) and "{}" in t for t in templates)):
            raise ValueError(f"{META_TEMPLATES} must be a list of templates, each with a {{}}")
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: bad text tower metadata ({one_line(e)})") from e
    state = {k[len(TEXT_PREFIX):]: v for k, v in tensors.items() if k.startswith(TEXT_PREFIX)}
    bundle = bundle_from_state(cfg, state, tok, scale, bias, source)
    bundle.templates = None if templates is None else tuple(templates)
    return bundle
