"""The BiT ResNet stem of the hybrid ViTs (paper §3.1, vit_jax `models_resnet.py`).

Weight-standardised convolutions with TF "SAME" padding, GroupNorm(32), and post-activation bottleneck
units. Module names follow timm's ResNetV2 so that timm hybrid state dicts load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TF 'SAME' padding for one axis: the extra pixel, if any, goes after (bottom / right).

    total = max((ceil(size / stride) - 1) * stride + kernel - size, 0), written with the remainder only: for
    sizes that are multiples of the stride (every size a hybrid accepts) it is a constant, so torch.export with
    symbolic H and W needs no guard on it.
    """
    rem = size % stride
    total = max(kernel - (rem if rem else stride), 0)
    return total // 2, total - total // 2


class StdConv2dSame(nn.Conv2d):
    """Conv2d with weight standardisation and TF 'SAME' padding, no bias.

    style "var": w' = (w - mean) / sqrt(var + eps) (timm); style "std": (w - mean) / (std + eps) (vit_jax).
    """

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int, stride: int = 1, eps: float = 1e-8,
                 style: str = "var") -> None:
        super().__init__(in_chs, out_chs, kernel_size, stride=stride, padding=0, bias=False)
        self.eps, self.style = eps, style

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        flat = w.reshape(1, w.shape[0], -1)
        if self.style == "std":
            mean = flat.mean(dim=2, keepdim=True)
            std = flat.var(dim=2, unbiased=False, keepdim=True).sqrt()
            return ((flat - mean) / (std + self.eps)).reshape_as(w)
        # batch_norm in training mode is exactly timm's formula (and one fused kernel).
        return F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=self.eps).reshape_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s = self.kernel_size[0], self.stride[0]
        (t, b), (left, r) = _same_pad(x.shape[-2], k, s), _same_pad(x.shape[-1], k, s)
        if t or b or left or r:
            x = F.pad(x, (left, r, t, b))
        return F.conv2d(x, self.standardized_weight(), None, self.stride)


class GroupNormAct(nn.GroupNorm):
    def __init__(self, channels: int, eps: float, act: bool = True) -> None:
        super().__init__(32, channels, eps=eps)
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class MaxPool2dSame(nn.Module):
    """3x3 / 2 max pool with TF 'SAME' padding (pads with -inf, as TF does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (t, b), (left, r) = _same_pad(x.shape[-2], 3, 2), _same_pad(x.shape[-1], 3, 2)
        x = F.pad(x, (left, r, t, b), value=float("-inf"))
        return F.max_pool2d(x, 3, 2)


class Downsample(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, stride: int, conv, norm) -> None:
        super().__init__()
        self.conv = conv(in_chs, out_chs, 1, stride)
        self.norm = norm(out_chs, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """Post-activation bottleneck unit (vit_jax ResidualUnit): 1x1, 3x3 (strided), 1x1, add, ReLU."""

    def __init__(self, in_chs: int, out_chs: int, stride: int, conv, norm) -> None:
        super().__init__()
        mid = out_chs // 4
        needs_proj = in_chs != out_chs or stride != 1
        self.downsample = Downsample(in_chs, out_chs, stride, conv, norm) if needs_proj else None
        self.conv1, self.norm1 = conv(in_chs, mid, 1), norm(mid)
        self.conv2, self.norm2 = conv(mid, mid, 3, stride), norm(mid)
        self.conv3, self.norm3 = conv(mid, out_chs, 1), norm(out_chs, act=False)
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.norm1(self.conv1(x))
        x = self.norm2(self.conv2(x))
        x = self.norm3(self.conv3(x))
        return self.act3(x + shortcut)


class ResNetStage(nn.Module):
    def __init__(self, in_chs: int, out_chs: int, depth: int, stride: int, conv, norm) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[
            Bottleneck(in_chs if i == 0 else out_chs, out_chs, stride if i == 0 else 1, conv, norm)
            for i in range(depth)
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ResNetStem(nn.Module):
    """Root block (7x7/2 conv, GN, ReLU, 3x3/2 max pool) and bottleneck stages; stride 4 * 2^(stages-1).

    Args:
        layers: units per stage, e.g. (3, 4, 9) for R50+ViT-B/16; () for the root block only.
        width: root width (64 x width factor); stage i outputs width * 4 * 2^i channels.
    """

    def __init__(self, in_chans: int, layers: tuple[int, ...], width: int = 64, std_conv_eps: float = 1e-8,
                 std_conv_style: str = "var", group_norm_eps: float = 1e-5) -> None:
        super().__init__()

        def conv(i: int, o: int, k: int, s: int = 1) -> StdConv2dSame:
            return StdConv2dSame(i, o, k, s, eps=std_conv_eps, style=std_conv_style)

        def norm(c: int, act: bool = True) -> GroupNormAct:
            return GroupNormAct(c, eps=group_norm_eps, act=act)

        self.stem = nn.Sequential()
        self.stem.add_module("conv", conv(in_chans, width, 7, 2))
        self.stem.add_module("norm", norm(width))
        self.stem.add_module("pool", MaxPool2dSame())
        stages, chs = [], width
        for i, depth in enumerate(layers):
            out = width * 4 * 2**i
            stages.append(ResNetStage(chs, out, depth, 1 if i == 0 else 2, conv, norm))
            chs = out
        self.stages = nn.Sequential(*stages)
        self.out_chs = chs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))
