"""The paper's optimisers and learning-rate schedules, as small pure builders."""

from __future__ import annotations

import math

import torch

from vit_serve.train.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay only weight matrices and conv kernels (big_vision decays '.*/kernel'); never biases, norms,
    position embeddings, the [class] or [mask] tokens."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_kernel = p.ndim >= 2 and not any(t in name for t in ("pos_embed", "cls_token", "mask_token"))
        (decay if is_kernel else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """adam (pretrain default): Adam(0.9, 0.999) with decoupled weight decay (AdamW); sgd (finetune
    default): SGD with momentum 0.9."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


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
