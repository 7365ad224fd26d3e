"""The paper's optimisers and learning-rate schedules, as small pure builders; layer-wise lr decay (timm's
`param_groups_layer_decay`, MAE's `param_groups_lrd`)."""

from __future__ import annotations

import math
import re

import torch

from vit_serve.train.config import TrainConfig

_TOKENS = ("pos_embed", "cls_token", "dist_token", "reg_token")  # timm's VisionTransformer.no_weight_decay()
# RoPE-ViT mixed's learned frequencies [2, depth, heads, hd / 2]: no weight decay (timm's Eva.no_weight_decay); under
# layer decay timm's group_matcher matches them to no layer, so they take the head's lr, as here (`layer_id`).
_ROPE_FREQS = "rope.freqs"
_NO_DECAY = (*_TOKENS, "mask_token", _ROPE_FREQS)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices and conv kernels (big_vision decays '.*/kernel'); never biases, norms,
    position embeddings, the [class], [dist], register or [mask] tokens, RoPE's learned frequencies."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_kernel = p.ndim >= 2 and not any(t in name for t in _NO_DECAY)
        (decay if is_kernel else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


_STEM = re.compile(r"^(patch_embed\.|norm_pre\.|mask_token$|(pos_embed|cls_token|dist_token|reg_token)$)")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def layer_id(name: str, depth: int) -> int:
    """The layer of parameter `name` (timm's names, relative to the VisionTransformer) for lr decay, as timm's
    `group_matcher` and MAE's `get_layer_id_for_vit`: 0 for the embeddings (patch_embed, [class], [dist],
    registers, pos_embed, norm_pre; MPP's [mask]), i + 1 for blocks.i, depth + 1 for everything after the encoder
    (norm, fc_norm, attn_pool, pre_logits, proj, head, head_dist; MPP's head) and for what timm's matcher leaves
    unmatched (RoPE-ViT mixed's rope.freqs: timm's Eva gives it the head's lr)."""
    if _STEM.match(name):
        return 0
    if m := _BLOCK.match(name):
        return int(m[1]) + 1
    return depth + 1


def layer_decay_groups(model: torch.nn.Module, weight_decay: float, layer_decay: float, depth: int) -> list[dict]:
    """Parameter groups with layer-wise lr decay, as timm's `param_groups_layer_decay` (BEiT, MAE): one group
    per (layer, decay or not), lr_scale = layer_decay^(depth + 1 - layer id); no weight decay on 1-D
    parameters (biases, norms, LayerScale gammas) and the tokens and position embeddings. Names under an
    MPPModel (`vit.`) count as the ViT's.
    RoPE-ViT mixed's learned frequencies (`rope.freqs`) take the head's lr without weight decay, as in timm."""
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = name.removeprefix("vit.")
        layer = layer_id(plain, depth)
        no_decay = p.ndim <= 1 or plain in _NO_DECAY
        key = f"layer_{layer}_{'no_decay' if no_decay else 'decay'}"
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                           "lr_scale": layer_decay ** (depth + 1 - layer)}
        groups[key]["params"].append(p)
    return list(groups.values())


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, depth: int | None = None) -> torch.optim.Optimizer:
    """adam (pretrain default): Adam(0.9, 0.999) with decoupled weight decay (AdamW); sgd (finetune
    default): SGD with momentum 0.9. With `cfg.layer_decay` (needs the encoder's `depth`), each group's lr is
    cfg.lr x its `lr_scale` (the schedule multiplies every group's alike)."""
    if cfg.layer_decay is not None:
        if depth is None:
            raise ValueError("layer-wise lr decay needs the model's depth")
        groups = layer_decay_groups(model, cfg.weight_decay, cfg.layer_decay, depth)
        for g in groups:
            g["lr"] = cfg.lr * g["lr_scale"]
    else:
        groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return opt


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr after `step` optimizer steps: linear warm-up, then cosine or linear decay."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1 - min_ratio) * decay


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.steps, cfg.warmup_steps, cfg.schedule, min_ratio))
