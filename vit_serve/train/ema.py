"""An exponential moving average of a model's weights, as timm's `ModelEmaV3` (constant decay, no warm-up).

After every optimizer step, ema = decay x ema + (1 - decay) x w for every parameter (`torch._foreach_lerp_`,
the op timm uses, so the two agree bit for bit); buffers are copied (timm's `exclude_buffers=True`; our ViT
has no floating-point buffers, so it equals timm's default too). The average starts as a copy of the weights.
"""

from __future__ import annotations

import copy

import torch


class ModelEMA:
    """The averaged copy `module` (in eval mode, no gradients) of `model`; `update(model)` after each step."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """ema <- lerp(ema, w, 1 - decay) for the parameters; the buffers copied."""
        torch._foreach_lerp_(list(self.module.parameters()), [p.detach() for p in model.parameters()],
                             weight=1.0 - self.decay)
        for ema_b, b in zip(self.module.buffers(), model.buffers(), strict=True):
            ema_b.copy_(b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
