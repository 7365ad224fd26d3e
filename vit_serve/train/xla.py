"""XLA / TPU glue (the `[tpu]` extra: torch_xla with its matching torch release).

The step stays XLA-friendly: no host syncs inside the loop (the loss is read only at log steps),
`xm.optimizer_step` (which also all-reduces gradients across replicas), then a graph cut per step.
On TPU, attention runs the Pallas flash-attention kernel when torch_xla ships it.
"""

from __future__ import annotations

from functools import partial

import torch


def available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def hardware(dev: torch.device) -> str:
    """"TPU", "CPU", "CUDA" ... of an XLA device."""
    import torch_xla.core.xla_model as xm

    return xm.xla_device_hw(dev)


def _pallas_attention(flash_attention, q, k, v, dropout_p: float = 0.0):
    if dropout_p:
        raise ValueError("the Pallas flash-attention kernel has no attention dropout; set --attn-dropout 0")
    return flash_attention(q, k, v, causal=False, sm_scale=q.shape[-1] ** -0.5)


def use_pallas_attention(model: torch.nn.Module) -> bool:
    """Route every Attention module through Pallas flash attention; False when the kernel is unavailable."""
    try:
        from torch_xla.experimental.custom_kernel import flash_attention
    except ImportError:
        return False
    from vit_serve.model import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            m.attention_fn = partial(_pallas_attention, flash_attention)
    return True


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    import torch_xla.core.xla_model as xm

    xm.optimizer_step(optimizer)


def sync() -> None:
    """Cut the lazy graph here and run it (one compiled step)."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # older releases
        import torch_xla.core.xla_model as xm

        xm.mark_step()

