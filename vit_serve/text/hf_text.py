"""Hugging Face CLIPModel / SiglipModel (and *TextModel) folders -> our TextTransformer.

Reproduces transformers' `get_text_features` (input ids only, padded to max_position_embeddings, as the
processors' padding="max_length"): CLIP pools at the first eos_token_id (argmax of the ids for the legacy
eos_token_id 2) and applies the bias-free `text_projection`; SigLIP pools the last position through
`text_model.head` (with bias). The tokenizer is the folder's tokenizer.json.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError
from vit_serve.checkpoints.io import read_weights
from vit_serve.text.bundle import TextBundle, bundle_from_state
from vit_serve.text.open_clip_text import hf_pad_id
from vit_serve.text.tokenizer import TOKENIZER_FILE, HFTokenizer, TokenizerError
from vit_serve.text.tokenizer_config import as_transformers_loads, read_tokenizer_config
from vit_serve.text.tower import TextConfig

HF_TEXT_TYPES = ("clip", "siglip", "siglip2", "clip_text_model", "siglip_text_model", "siglip2_text_model")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_ACTS = {"quick_gelu": "quick", "gelu": "exact", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
_NAMES = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj", "mlp.fc1": "mlp.fc1",
          "mlp.fc2": "mlp.fc2"}


def _config(model_type: str, tc: Mapping[str, Any], sd: Mapping[str, torch.Tensor]) -> TextConfig:
    siglip = model_type.startswith("siglip")
    act = tc.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu")
    if act not in _ACTS:
        raise CheckpointError(f"transformers text hidden_act {act!r} is not supported")
    eos = tc.get("eos_token_id", 2)
    proj = sd.get("head.weight") if siglip else sd.get("text_projection.weight")
    return TextConfig(
        vocab_size=sd["embeddings.token_embedding.weight"].shape[0],
        context_length=sd["embeddings.position_embedding.weight"].shape[0],
        width=sd["embeddings.token_embedding.weight"].shape[1], heads=tc.get("num_attention_heads", 8),
        layers=1 + max(int(m[1]) for k in sd if (m := _LAYER.match(k))),
        mlp_dim=sd["encoder.layers.0.mlp.fc1.weight"].shape[0], proj_dim=None if proj is None else proj.shape[0],
        proj_bias=siglip and proj is not None, causal=not siglip,
        pool="last" if siglip else ("argmax" if eos == 2 else "eos"), eos_id=None if siglip or eos == 2 else eos,
        gelu=_ACTS[act], layer_norm_eps=tc.get("layer_norm_eps", 1e-6 if siglip else 1e-5))


def _rename(sd: Mapping[str, torch.Tensor], cfg: TextConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {"token_embedding.weight": sd["embeddings.token_embedding.weight"],
                                    "positional_embedding": sd["embeddings.position_embedding.weight"]}
    for k, v in sd.items():
        if m := _LAYER.match(k):
            i, rest = m[1], m[2]
            if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
                continue
            for src, dst in _NAMES.items():
                if rest.startswith(src + "."):
                    out[f"blocks.{i}.{dst}{rest[len(src):]}"] = v
        elif k.startswith("final_layer_norm."):
            out["ln_final." + k.split(".", 1)[1]] = v
        elif k.startswith(("head.", "text_projection.")):
            out["proj." + k.split(".", 1)[1]] = v
    for i in range(cfg.layers):
        p = f"encoder.layers.{i}.self_attn."
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([sd[p + f"{n}_proj.weight"] for n in "qkv"])
        out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([sd[p + f"{n}_proj.bias"] for n in "qkv"])
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return read_weights(folder / name)[0]
    raise CheckpointError(f"transformers folder {folder} has no model.safetensors or pytorch_model.bin")


def is_hf_text_folder(folder: Path) -> bool:
    """A transformers folder whose config is a CLIP / SigLIP model with a text tower."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg.get("model_type") in HF_TEXT_TYPES


def read_hf_text(folder: str | Path) -> TextBundle | None:
    """The text tower of a transformers CLIP / SigLIP folder (None when the weights hold no text tower)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    model_type = cfg.get("model_type", "")
    tc = cfg.get("text_config", cfg) if model_type in ("clip", "siglip", "siglip2") else cfg
    weights = _weights(folder)
    top = {k: v for k, v in weights.items() if not k.startswith("text_model.")}
    sd = {k[len("text_model."):]: v for k, v in weights.items() if k.startswith("text_model.")}
    if "embeddings.token_embedding.weight" not in sd:
        return None
    if "text_projection.weight" in top:
        sd["text_projection.weight"] = top["text_projection.weight"]
    tcfg = _config(model_type, tc, sd)
    tok_file = folder / TOKENIZER_FILE
    if not tok_file.is_file():
        raise TokenizerError(f"the tokenizer of {folder} is not local: it needs {TOKENIZER_FILE} in that folder "
                             "(save it with the model's tokenizer.save_pretrained; nothing is downloaded)")
    text, side = tok_file.read_text(encoding="utf-8"), "right"
    if model_type.startswith("siglip2"):  # transformers 5 tokenizes siglip2 folders with Siglip2Tokenizer, whatever
        # tokenizer_config.json names (siglip2 is among its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
        config = {**read_tokenizer_config(folder), "tokenizer_class": "Siglip2Tokenizer"}
        text, side = as_transformers_loads(text, config)
    tok = HFTokenizer(text, tcfg.context_length, hf_pad_id(text, folder), padding_side=side)
    scale = float(top["logit_scale"].reshape(-1)[0]) if "logit_scale" in top else float(
        cfg.get("logit_scale_init_value", 2.6592))
    bias = float(top["logit_bias"].reshape(-1)[0]) if "logit_bias" in top else None
    return bundle_from_state(tcfg, _rename(sd, tcfg), tok, scale, bias, f"transformers {model_type} folder {folder}")
