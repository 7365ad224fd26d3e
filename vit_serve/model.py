"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020): architecture only.

    z0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (Eq. 1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                        (Eq. 2)
    z_l = MLP(LN(z'_l)) + z'_l                               (Eq. 3)
    y = LN(z_L^0)                                            (Eq. 4)

Parameter names follow timm, so a timm state dict is our state dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vit_serve.config import ViTConfig, get_config
from vit_serve.pos_embed import is_tracing, resample_pos_embed
from vit_serve.resnet import ResNetStem


class PatchEmbed(nn.Module):
    """Linear projection of flattened P x P patches, as a conv with kernel = stride = P (hybrid: ResNet first)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.backbone = None
        in_chs = cfg.in_chans
        if cfg.resnet_layers is not None:
            self.backbone = ResNetStem(cfg.in_chans, cfg.resnet_layers, cfg.resnet_width, cfg.std_conv_eps,
                                       cfg.std_conv_style, cfg.group_norm_eps)
            in_chs = self.backbone.out_chs
        k = cfg.patch_size // cfg.backbone_stride
        self.proj = nn.Conv2d(in_chs, cfg.embed_dim, kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/P) * (W/P), D], row-major over the patch grid."""
        if self.backbone is not None:
            x = self.backbone(x)
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with two paths that agree to float rounding.

    Fused (default): F.scaled_dot_product_attention, i.e. FlashAttention / memory-efficient kernels on CUDA.
    Explicit (only when asked): softmax(q k^T / sqrt(d)) v, also returning the probabilities [B, heads, N, N].
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # The fused kernel; swappable for an accelerator's own (e.g. Pallas flash attention on TPU).
        self.attention_fn: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        drop = self.attn_drop if self.training else 0.0
        probs = None
        if return_attention:
            probs = (q * self.scale @ k.transpose(-2, -1)).softmax(dim=-1)
            x = (F.dropout(probs, drop) if drop else probs) @ v
        else:
            x = self.attention_fn(q, k, v, dropout_p=drop)
        x = self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
        return x, probs


class Mlp(nn.Module):
    """Two layers with a GELU between (paper: "two layers with a GELU non-linearity")."""

    def __init__(self, dim: int, hidden: int, gelu: str = "exact", drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh" if gelu == "tanh" else "none")
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the residual branch per sample with probability p, rescaling the kept ones."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class Block(nn.Module):
    """Pre-LN encoder block (Eq. 2-3)."""

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = Attention(d, cfg.num_heads, cfg.qkv_bias, cfg.attn_drop_rate, cfg.drop_rate)
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(d, cfg.mlp_dim, cfg.gelu, cfg.drop_rate)
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor, return_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, attn = self.attn(self.norm1(x), return_attention)
        x = x + drop_path(y, self.drop_path_rate, self.training)
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path_rate, self.training)
        return x, attn


class VisionTransformer(nn.Module):
    """ViT (and R50 hybrid) at any resolution that is a multiple of the patch size.

    API: forward_features (tokens after the final LayerNorm), pool, forward_head(pre_logits=False), forward.
    Pass return_attention=True to forward / forward_features to also get one [B, heads, N, N] attention
    probability tensor per layer (the explicit attention path; the fused path is used otherwise).
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_prefix_tokens = cfg.num_prefix_tokens
        d = cfg.embed_dim
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.class_token else None
        gh, gw = cfg.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + gh * gw, d))
        self.pos_drop = nn.Dropout(cfg.drop_rate)
        # Stochastic depth grows linearly with depth, as in timm.
        dpr = [cfg.drop_path_rate * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList([Block(cfg, r) for r in dpr])
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.pre_logits = self._make_pre_logits(cfg)
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(self.num_features, cfg.num_classes) if cfg.num_classes else nn.Identity()
        self.init_weights()
        # Metadata that travels with the weights (set by vit_serve.checkpoints): class names and the
        # preprocessing contract (vit_serve.preprocess.PreprocessConfig).
        self.labels: list[str] | None = None
        self.preprocess_cfg = None
        self.grad_checkpointing = False  # recompute each block in backward: memory for time (L/H models)
        # While tracing/exporting, resample even at the native grid so the graph serves any size; False bakes
        # the position embeddings in as constants (a static-resolution export).
        self.dynamic_size = True

    @staticmethod
    def _make_pre_logits(cfg: ViTConfig) -> nn.Module:
        if not cfg.representation_size:
            return nn.Identity()
        return nn.Sequential(nn.Linear(cfg.embed_dim, cfg.representation_size), nn.Tanh())

    @property
    def num_features(self) -> int:
        return self.cfg.representation_size or self.cfg.embed_dim

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.cfg.grid_size

    # -- initialisation (vit_jax) ---------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """vit_jax init: xavier-uniform Linear, lecun-normal patch conv, pos_embed N(0, 0.02), zero head."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=1e-6) if ".mlp." in f".{name}." else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d) and name == "patch_embed.proj":
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
                nn.init.trunc_normal_(m.weight, std=math.sqrt(1 / fan_in) / 0.87962566103423978)
                nn.init.zeros_(m.bias)
        self.reset_pos_embed()
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    # -- resolution -----------------------------------------------------------------------------------
    def check_size(self, h: int, w: int) -> tuple[int, int]:
        """Patch grid for an H x W input; ValueError naming the nearest valid sizes otherwise."""
        p = self.cfg.patch_size
        if h % p or w % p or h <= 0 or w <= 0:
            def near(s: int) -> str:
                lo, hi = max(s // p * p, p), max(-(-s // p) * p, p)
                return str(lo) if lo == hi else f"{lo} or {hi}"
            raise ValueError(f"input size {h}x{w} is not a multiple of the patch size {p}; "
                             f"nearest valid sizes: height {near(h)}, width {near(w)}")
        return h // p, w // p

    def set_resolution(self, h: int, w: int | None = None, mode: str | None = None) -> None:
        """Resample the position embeddings permanently to H x W (paper §3.2)."""
        w = h if w is None else w
        grid = self.check_size(h, w)
        mode = mode or self.cfg.resample_mode
        new = resample_pos_embed(self.pos_embed.detach(), self.grid_size, grid, self.num_prefix_tokens, mode)
        self.pos_embed = nn.Parameter(new.clone())
        self.cfg = self.cfg.replace(img_size=(h, w))
        if self.preprocess_cfg is not None:
            self.preprocess_cfg = self.preprocess_cfg.with_size(h, w)

    def reset_pos_embed(self) -> None:
        """Fresh position embeddings, N(0, 0.02²) as at initialisation (the control of resolution transfer)."""
        nn.init.normal_(self.pos_embed, std=0.02)

    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """Replace the head with a zero-initialised D x K layer (paper §3.2), dropping pre_logits by default."""
        if not keep_pre_logits:
            self.pre_logits = nn.Identity()
            self.cfg = self.cfg.replace(representation_size=None)
        self.cfg = self.cfg.replace(num_classes=num_classes)
        self.labels = None
        ref = self.pos_embed
        self.head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype) \
            if num_classes else nn.Identity()
        if num_classes:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def _pos_embed(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        pos = self.pos_embed
        if (self.dynamic_size and is_tracing()) or grid != self.grid_size:  # no symbolic compare when tracing
            pos = resample_pos_embed(pos, self.grid_size, grid, self.num_prefix_tokens, self.cfg.resample_mode)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + pos)

    # -- forward --------------------------------------------------------------------------------------
    def forward_features(self, x: torch.Tensor, return_attention: bool = False):
        """[B, C, H, W] -> tokens [B, prefix + N, D] after the final LayerNorm (and attentions if asked)."""
        grid = self.check_size(x.shape[-2], x.shape[-1])
        x = self._pos_embed(self.patch_embed(x), grid)
        attentions = []
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and not return_attention:
                x, attn = checkpoint(blk, x, use_reentrant=False)
            else:
                x, attn = blk(x, return_attention)
            if return_attention:
                attentions.append(attn)
        x = self.norm(x)
        return (x, attentions) if return_attention else x

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens -> image representation: the [class] token, or the mean of the patch tokens (GAP)."""
        if self.cfg.pool == "token":
            return x[:, 0]
        return x[:, self.num_prefix_tokens:].mean(dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.pre_logits(self.pool(x))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_embedding(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C, H, W] -> (logits [B, K], embedding [B, D]) from one pass: the embedding is
        `forward_head(tokens, pre_logits=True)` (timm's image representation), the logits the head applied to it."""
        embedding = self.forward_head(self.forward_features(x), pre_logits=True)
        return self.head(embedding), embedding

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        """[B, C, H, W] -> logits [B, K]; with return_attention, (logits, [attn [B, heads, N, N]] * depth)."""
        if return_attention:
            feats, attentions = self.forward_features(x, return_attention=True)
            return self.forward_head(feats), attentions
        return self.forward_head(self.forward_features(x))


def create_model(name_or_cfg: str | ViTConfig = "B/16", **overrides) -> VisionTransformer:
    """A randomly initialised model from a preset name or a ViTConfig (keyword overrides replace fields)."""
    cfg = get_config(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else name_or_cfg.replace(**overrides)
    return VisionTransformer(cfg)
