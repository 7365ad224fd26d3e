"""open_clip text towers -> our TextTransformer; reproduces `open_clip model.encode_text` exactly.

CLIP keeps the text tower at the top level (token_embedding, positional_embedding, transformer.resblocks.*,
ln_final, text_projection [W, E]); CustomTextCLIP (SigLIP configs) under `text.` (text_projection a Linear
with bias). Blocks map as the image tower's (open_clip_state.block_key). The tokenizer: open_clip's
SimpleTokenizer, or for configs naming a Hugging Face tokenizer (`hf_tokenizer_name`: SigLIP's T5 and SigLIP 2's
Gemma) a tokenizer.json found beside the weights, with its tokenizer_config.json read as transformers reads it
(`tokenizer_config`; never downloaded).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vit_serve.checkpoints.converted import CheckpointError, strip_prefixes
from vit_serve.checkpoints.open_clip_state import _BLOCK, block_key, model_config
from vit_serve.checkpoints.unsupported import UnsupportedCheckpoint
from vit_serve.text.bundle import TextBundle, bundle_from_state
from vit_serve.text.tokenizer import TOKENIZER_FILE, HFTokenizer, OpenClipTokenizer, Tokenizer, TokenizerError
from vit_serve.text.tokenizer_config import TOKENIZER_CONFIG_FILE, as_transformers_loads, read_tokenizer_config
from vit_serve.text.tower import TextConfig

_UNSUPPORTED = ("hf_model_name", "embed_cls", "qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner",
                "scale_attn", "scale_fc", "final_ln_after_pool")


def text_tower_keys(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text tower's entries of an open_clip state dict, without the `text.` of CustomTextCLIP."""
    if "text.token_embedding.weight" in sd:
        return {k[len("text."):]: v for k, v in sd.items() if k.startswith("text.")}
    names = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")
    return {k: v for k, v in sd.items() if k.startswith(names)}


def _config(cfg: Mapping[str, Any], sd: Mapping[str, torch.Tensor]) -> TextConfig:
    t = cfg.get("text_cfg", {})
    for key in _UNSUPPORTED:
        if t.get(key):
            raise UnsupportedCheckpoint(f"open_clip text option {key} is not supported")
    if t.get("pool_type", "argmax") not in ("argmax", "last", "eos"):
        raise UnsupportedCheckpoint(f"open_clip text pool_type {t['pool_type']!r} is not supported")
    proj = sd.get("text_projection", sd.get("text_projection.weight"))
    act = (t.get("act_kwargs") or {}).get("approximate")
    width = sd["token_embedding.weight"].shape[1]
    return TextConfig(
        vocab_size=sd["token_embedding.weight"].shape[0], context_length=sd["positional_embedding"].shape[0],
        width=width, heads=t.get("heads", 8), layers=1 + max(int(m[1]) for k in sd if (m := _BLOCK.match(k))),
        mlp_dim=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        proj_dim=None if proj is None else (proj.shape[0] if "text_projection.weight" in sd else proj.shape[1]),
        proj_bias="text_projection.bias" in sd, causal=not t.get("no_causal_mask", False),
        pool=t.get("pool_type", "argmax"), eos_id=t.get("eos_id", 2) if t.get("pool_type") == "eos" else None,
        gelu="quick" if cfg.get("quick_gelu") else ("tanh" if act == "tanh" else "exact"),
        layer_norm_eps=(t.get("norm_kwargs") or {}).get("eps", 1e-5),
        init_values=1.0 if "transformer.resblocks.0.ls_1.gamma" in sd else None)


def _rename(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if name := block_key(k):
            out[name] = v
        elif k == "text_projection":
            out["proj.weight"] = v.t().contiguous()
        elif k.startswith("text_projection."):
            out["proj." + k.split(".", 1)[1]] = v
        else:
            out[k] = v
    return out


def hf_pad_id(tokenizer_json: str, folder: Path) -> int:
    """The pad id of a tokenizer.json: its padding section, else tokenizer_config.json's pad_token, else 0."""
    data = json.loads(tokenizer_json)
    if (data.get("padding") or {}).get("pad_id") is not None:
        return int(data["padding"]["pad_id"])
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            pad = json.loads((folder / name).read_text()).get("pad_token")
            pad = pad.get("content") if isinstance(pad, dict) else pad
            for tok in data.get("added_tokens", []):
                if pad is not None and tok.get("content") == pad:
                    return int(tok["id"])
            if pad is not None and pad in (data.get("model", {}).get("vocab") or {}):
                vocab = data["model"]["vocab"]
                return int(vocab[pad]) if isinstance(vocab, dict) else 0
    return 0


def _tokenizer(cfg: Mapping[str, Any], context_length: int, folder: Path | None) -> Tokenizer:
    t = cfg.get("text_cfg", {})
    clean = (t.get("tokenizer_kwargs") or {}).get("clean")
    if not t.get("hf_tokenizer_name"):
        return OpenClipTokenizer(context_length, clean or "lower")
    path = (folder or Path(".")) / TOKENIZER_FILE
    if folder is None or not path.is_file():
        raise TokenizerError(f"the tokenizer of this open_clip config ({t['hf_tokenizer_name']}) is not local: "
                             f"put its {TOKENIZER_FILE} (and {TOKENIZER_CONFIG_FILE}) beside the weights"
                             f"{f' in {folder}' if folder else ''} (nothing is downloaded)")
    text = path.read_text(encoding="utf-8")
    try:  # what open_clip's HFTokenizer gets from transformers' AutoTokenizer for this folder
        run, side = as_transformers_loads(text, read_tokenizer_config(path.parent))
    except ValueError as e:
        raise TokenizerError(f"{path.parent}: {e}") from None
    return HFTokenizer(run, context_length, hf_pad_id(text, path.parent), clean or "whitespace", side)


def convert_open_clip_text(weights: Mapping[str, torch.Tensor], arch: str,
                           folder: Path | None = None) -> TextBundle | None:
    """The text tower of an open_clip state dict (None when it holds none); `folder`: where a tokenizer.json
    may lie (beside the weights)."""
    cfg = model_config(arch)
    sd = text_tower_keys(strip_prefixes(weights, ("module.", "_orig_mod.")))
    if "token_embedding.weight" not in sd:
        return None
    try:
        tcfg = _config(cfg, sd)
    except (KeyError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"open_clip text tower for {arch}: cannot infer it ({e})") from e
    top = strip_prefixes(weights, ("module.", "_orig_mod."))
    scale = float(top["logit_scale"].reshape(-1)[0]) if "logit_scale" in top else float(torch.tensor(1 / 0.07).log())
    bias = float(top["logit_bias"].reshape(-1)[0]) if "logit_bias" in top else None
    tok = _tokenizer(cfg, tcfg.context_length, folder)
    return bundle_from_state(tcfg, _rename(sd), tok, scale, bias, f"open_clip {arch} text tower")
