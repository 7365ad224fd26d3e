"""The Vision Transformer of "An Image is Worth 16x16 Words" (Dosovitskiy et al., 2020): architecture only.

    z0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (Eq. 1)
    z'_l = MSA(LN(z_{l-1})) + z_{l-1}                        (Eq. 2)
    z_l = MLP(LN(z'_l)) + z'_l                               (Eq. 3)
    y = LN(z_L^0)                                            (Eq. 4)

The families people deploy are options of this one model (ViTConfig), each reproducing its source:
DeiT's distillation token, DINOv2's LayerScale and registers, CLIP's pre-encoder LayerNorm, QuickGELU and
projection, SigLIP's attention-pool (MAP) head without a class token; and timm's `Eva` pieces (EVA-02, PE,
DINOv3, RoPE-ViT): 2-D rotary position embeddings (vit_serve.rope) with or without absolute ones, SwiGLU MLPs
(with EVA's sub-LayerNorm), q/v-only biases, fc_norm. Parameter names follow timm, so a timm VisionTransformer
state dict is our state dict (an Eva one is renamed by vit_serve.checkpoints.timm_eva).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vit_serve import naflex
from vit_serve.config import RopeConfig, ViTConfig, get_config
from vit_serve.pos_embed import is_tracing, resample_patch_embed, resample_pos_embed
from vit_serve.resnet import ResNetStem
from vit_serve.rope import init_mixed_freqs, rope_table, rotate_patches
from vit_serve.tome import LayerMerge, MergeState, TokenMerging, TomeR, parse_r, size_bias


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
        self.proj = nn.Conv2d(in_chs, cfg.embed_dim, kernel_size=k, stride=k, bias=cfg.patch_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/P) * (W/P), D], row-major over the patch grid."""
        if self.backbone is not None:
            x = self.backbone(x)
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with two paths that agree to float rounding.

    Fused (default): F.scaled_dot_product_attention, i.e. FlashAttention / memory-efficient kernels on CUDA.
    Explicit (only when asked): softmax(q k^T / sqrt(d)) v, also returning the probabilities [B, heads, N, N].
    With RoPE (`rope` set), q and k of the patch tokens are rotated before either path, so the probabilities
    are those after rotation; the `num_prefix` class / register tokens are not rotated (as timm's Eva).
    `k_bias=False`: the key has no bias (EVA's q_bias / v_bias; the k third of `qkv.bias` is ignored).
    `attn_norm`: a LayerNorm on the heads' output before `proj` (EVA-CLIP).
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, k_bias: bool = True, attn_norm: bool = False, eps: float = 1e-6,
                 rope: RopeConfig | None = None, num_prefix: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.k_bias = k_bias
        self.rope = rope
        self.num_prefix = num_prefix
        self.attn_drop = attn_drop
        self.norm = nn.LayerNorm(dim, eps=eps) if attn_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # The fused kernel; swappable for an accelerator's own (e.g. Pallas flash attention on TPU).
        self.attention_fn: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        b = self.qkv.bias
        if self.k_bias or b is None:
            return self.qkv(x)
        d = b.shape[0] // 3
        return F.linear(x, self.qkv.weight, torch.cat([b[:d], torch.zeros_like(b[d:2 * d]), b[2 * d:]]))

    def forward(self, x: torch.Tensor, return_attention: bool = False, bias: torch.Tensor | None = None,
                keys: bool = False, rope: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x [B, N, C] -> (out [B, N, C], probabilities [B, heads, N, N] if asked, the keys averaged over heads
        [B, N, C / heads] if asked: token merging's similarity). `bias` [B, 1, 1, N] is added to the logits
        (token merging's proportional attention, log of the token sizes). `rope`: the rotary table of the patch
        grid (vit_serve.rope), required when the attention was built with RoPE."""
        B, N, C = x.shape
        q, k, v = self._qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.rope is not None:
            if rope is None:
                raise ValueError("this attention uses RoPE: pass the grid's rotary table (VisionTransformer does)")
            q = rotate_patches(q, rope, self.num_prefix, self.rope.rotate_half)
            k = rotate_patches(k, rope, self.num_prefix, self.rope.rotate_half)
        drop = self.attn_drop if self.training else 0.0
        probs = None
        if return_attention:
            logits = q * self.scale @ k.transpose(-2, -1)
            probs = (logits if bias is None else logits + bias).softmax(dim=-1)
            x = (F.dropout(probs, drop) if drop else probs) @ v
        elif bias is not None:
            x = self.attention_fn(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=drop)
        else:
            x = self.attention_fn(q, k, v, dropout_p=drop)
        x = self.proj_drop(self.proj(self.norm(x.transpose(1, 2).reshape(B, N, C))))
        return x, probs, (k.mean(1) if keys else None)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with (open_clip, transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def make_act(gelu: str) -> nn.Module:
    """ViTConfig.gelu -> the activation module: exact (erf), tanh approximation, or QuickGELU."""
    return QuickGELU() if gelu == "quick" else nn.GELU(approximate="tanh" if gelu == "tanh" else "none")


class Mlp(nn.Module):
    """Two layers with a GELU between (paper: "two layers with a GELU non-linearity"); `norm_eps`: a LayerNorm
    on the hidden layer before fc2 (timm's scale_mlp)."""

    def __init__(self, dim: int, hidden: int, gelu: str = "exact", drop: float = 0.0,
                 norm_eps: float | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = make_act(gelu)
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.norm(self.drop(self.act(self.fc1(x))))))


class SwiGLU(nn.Module):
    """fc2(silu(fc1_g x) * fc1_x x) (Shazeer 2020), `hidden` wide per branch; `norm_eps`: EVA-02's sub-LayerNorm
    on the gated product before fc2. timm's `SwiGLU` (its packed `GluMlp` is split into fc1_g / fc1_x on import)."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0, norm_eps: float | None = None) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden)
        self.fc1_x = nn.Linear(dim, hidden)
        self.act = nn.SiLU()
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.norm(self.drop(self.act(self.fc1_g(x)) * self.fc1_x(x)))))


def make_mlp(cfg: ViTConfig) -> nn.Module:
    """The block's MLP of `cfg.mlp`: GELU (the paper's) or SwiGLU, with EVA-02's sub-LayerNorm if `mlp_norm`."""
    eps = cfg.layer_norm_eps if cfg.mlp_norm else None
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.embed_dim, cfg.mlp_dim, cfg.drop_rate, eps)
    return Mlp(cfg.embed_dim, cfg.mlp_dim, cfg.gelu, cfg.drop_rate, eps)


class RotaryEmbedding(nn.Module):
    """A model's RoPE (`cfg.rope`): forward(h, w) -> the table of the H x W patch grid, [N, 2 hd], or for
    "mixed" [depth, heads, N, 2 hd] from its learned frequencies `freqs` [2, depth, heads, hd / 2] (timm's
    `rope.freqs`; block i reads row i)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        assert cfg.rope is not None
        self.rope = cfg.rope
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.freqs = None
        if cfg.rope.kind == "mixed":
            self.freqs = nn.Parameter(init_mixed_freqs(self.head_dim, cfg.depth, cfg.num_heads, cfg.rope.temperature))

    def forward(self, h, w) -> torch.Tensor:
        r = self.rope
        return rope_table(r.kind, h, w, self.head_dim, r.temperature, r.grid_offset, r.grid_indexing, r.ref_grid,
                          r.rotate_half, self.freqs)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the residual branch per sample with probability p, rescaling the kept ones."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class LayerScale(nn.Module):
    """Per-channel scaling of a residual branch, x * gamma (CaiT; DINOv2's layer_scale / open_clip's ls_1)."""

    def __init__(self, dim: int, init_values: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-LN encoder block (Eq. 2-3), with LayerScale on both branches when `init_values` is set."""

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = Attention(d, cfg.num_heads, cfg.qkv_bias, cfg.attn_drop_rate, cfg.drop_rate, cfg.k_bias,
                              cfg.attn_norm, cfg.layer_norm_eps, cfg.rope, cfg.num_prefix_tokens)
        self.ls1 = LayerScale(d, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = make_mlp(cfg)
        self.ls2 = LayerScale(d, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor, return_attention: bool = False, merging: MergeState | None = None,
                rope: torch.Tensor | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, N, D] -> (x, attention probabilities if asked). With `merging` (token merging), its r tokens
        are merged between the attention and the MLP (ToMe), and the state's sizes and sources updated.
        `rope`: this block's rotary table (RoPE models). `mask` [B, 1, 1, N]: an additive key-padding mask (0 or
        -inf; NaFlex's padded patches)."""
        r = merging.next_r() if merging is not None else 0
        bias = size_bias(merging.size) if merging is not None and merging.prop_attn else mask
        y, attn, keys = self.attn(self.norm1(x), return_attention, bias, keys=r > 0, rope=rope)
        x = x + drop_path(self.ls1(y), self.drop_path_rate, self.training)
        if merging is not None:
            x = merging.merge(x, keys, r)
        x = x + drop_path(self.ls2(self.mlp(self.norm2(x))), self.drop_path_rate, self.training)
        return x, attn


class AttentionPool(nn.Module):
    """Multihead attention-pooling (MAP) head: one learned query attends over all tokens (SigLIP; timm's
    AttentionPoolLatent, big_vision's MAPHead), then a residual MLP: y = p + MLP(LN(p)), p = proj(attn(q, k, v)).

    tokens [B, N, D] -> [B, D]; with return_attention also the probe's probabilities [B, heads, 1, N].
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.num_heads = cfg.pool_heads or cfg.num_heads
        self.head_dim = d // self.num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, d))
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(d, cfg.pool_mlp_dim or cfg.mlp_dim, cfg.gelu)

    def forward(self, x: torch.Tensor, return_attention: bool = False,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`bias` [B, 1, 1, N]: added to the probe's logits (token merging: log of the token sizes)."""
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        probs = None
        if return_attention:
            logits = q * self.head_dim**-0.5 @ k.transpose(-2, -1)
            probs = (logits if bias is None else logits + bias).softmax(dim=-1)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias.to(q.dtype))
        y = self.proj(y.transpose(1, 2).reshape(B, 1, C))
        y = y + self.mlp(self.norm(y))
        return y[:, 0], probs


class VisionTransformer(nn.Module):
    """ViT (and R50 hybrid) at any resolution that is a multiple of the patch size.

    API: forward_features (tokens after the final LayerNorm), pool, forward_head(pre_logits=False), forward.
    Pass return_attention=True to forward / forward_features to also get one [B, heads, N, N] attention
    probability tensor per layer (the explicit attention path; the fused path is used otherwise);
    forward_explain also returns the token merges (with `set_token_merging`) that attention rollout follows.
    """

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_prefix_tokens = cfg.num_prefix_tokens
        d = cfg.embed_dim
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, d)) if cfg.reg_tokens else None
        gh, gw = cfg.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_pos_prefix_tokens + gh * gw, d)) if cfg.pos_embed \
            else None
        self.rope = RotaryEmbedding(cfg) if cfg.rope is not None else None
        self.pos_drop = nn.Dropout(cfg.drop_rate)
        self.norm_pre = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.norm_pre else nn.Identity()
        # Stochastic depth grows linearly with depth, as in timm.
        dpr = [cfg.drop_path_rate * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
        self.blocks = nn.ModuleList([Block(cfg, r) for r in dpr])
        self.norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.final_norm else nn.Identity()
        self.attn_pool = AttentionPool(cfg) if cfg.pool == "map" else None
        self.fc_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps) if cfg.fc_norm else nn.Identity()
        self.pre_logits = self._make_pre_logits(cfg)
        self.proj = nn.Linear(cfg.representation_size or d, cfg.proj_dim, bias=cfg.proj_bias) if cfg.proj_dim else None
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(self.num_features, cfg.num_classes) if cfg.num_classes else nn.Identity()
        # DeiT: a second head on the distillation token; at inference the two heads' logits are averaged.
        self.head_dist = nn.Linear(d, cfg.num_classes) if cfg.dist_token and cfg.num_classes else None
        self.distilled_training = False  # train/: forward returns (logits, dist logits) while training
        self.init_weights()
        # Metadata that travels with the weights (set by vit_serve.checkpoints): class names and the
        # preprocessing contract (vit_serve.preprocess.PreprocessConfig).
        self.labels: list[str] | None = None
        self.preprocess_cfg = None
        # The in-distribution sketch its OOD scores and drift compare with (vit_serve.monitor.Reference): made for
        # these weights at this resolution, so set_resolution and reset_head drop it.
        self.reference = None
        self.grad_checkpointing = False  # recompute each block in backward: memory for time (L/H models)
        # While tracing/exporting, resample even at the native grid so the graph serves any size; False bakes
        # the position embeddings in as constants (a static-resolution export).
        self.dynamic_size = True
        self.token_merging: TokenMerging | None = None  # set_token_merging
        self.tome_source: torch.Tensor | None = None  # the last forward's merge sources, when traced

    def set_token_merging(self, r: TomeR, prop_attn: bool = True,
                          trace_source: bool = False) -> None:
        """Token merging (ToMe, Bolya et al. 2023) in every block: r tokens merged per layer (an int, a list
        per layer, or (r, inflection) as the reference's parse_r); 0 turns it off. Class, distillation and
        register tokens are never merged. `prop_attn`: proportional attention (for models trained without
        ToMe); `trace_source`: keep the last forward's sources in `tome_source` [B, T, prefix + N]."""
        schedule = parse_r(len(self.blocks), r)
        if self.rope is not None and any(schedule):
            raise ValueError("token merging is not supported with RoPE: a merged token has no one position to "
                             "rotate by")
        self.token_merging = (TokenMerging(tuple(schedule), prop_attn, trace_source) if any(schedule) else None)
        self.tome_source = None

    @staticmethod
    def _make_pre_logits(cfg: ViTConfig) -> nn.Module:
        if not cfg.representation_size:
            return nn.Identity()
        return nn.Sequential(nn.Linear(cfg.embed_dim, cfg.representation_size), nn.Tanh())

    @property
    def num_features(self) -> int:
        """Width of the embedding the head reads."""
        return self.cfg.embed_dim_out

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
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.reset_pos_embed()
        for token in (self.dist_token, self.reg_token):  # timm: trunc-normal 0.02 / normal 1e-6
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.cfg.embed_dim**-0.5)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)

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
        self.check_size(h, w)
        if (h, w) != tuple(self.cfg.img_size):
            self.reference = None
        self._resample_to(self.grid_size, h, w, mode)

    def _resample_to(self, old_grid: tuple[int, int], h: int, w: int, mode: str | None) -> None:
        """The position embeddings resampled from `old_grid` to the grid of H x W at the current patch size;
        the config and the preprocessing contract at H x W."""
        p = self.cfg.patch_size
        if self.pos_embed is not None:  # RoPE tables follow the grid by themselves
            new = resample_pos_embed(self.pos_embed.detach(), old_grid, (h // p, w // p),
                                     self.cfg.num_pos_prefix_tokens, mode or self.cfg.resample_mode)
            self.pos_embed = nn.Parameter(new.clone())
        self.cfg = self.cfg.replace(img_size=(h, w))
        if self.preprocess_cfg is not None:
            self.preprocess_cfg = self.preprocess_cfg.with_size(h, w)

    def set_patch_size(self, p: int, res: tuple[int, int] | None = None, mode: str | None = None) -> None:
        """FlexiViT (Beyer et al., CVPR 2023): P x P patches from now on, at `res` (H, W; default the current
        resolution). The patch kernel is resized by its pseudo-inverse (`resample_patch_embed`) and the position
        embeddings resampled once, from the old grid to res / P (`resample_pos_embed`, `mode` default
        cfg.resample_mode), as timm's checkpoint loading does for a model created at another `img_size` and
        `patch_size`. ValueError for a P that does not divide the resolution."""
        h, w = res if res is not None else self.cfg.img_size
        if self.patch_embed.backbone is not None:
            raise ValueError("set_patch_size: a hybrid's patches come from its ResNet stem; its patch size is fixed")
        if not isinstance(p, int) or p <= 0 or h % p or w % p:
            raise ValueError(f"patch size {p} does not divide the resolution {h}x{w} (a divisor of both sides: "
                             f"{', '.join(str(d) for d in range(1, min(h, w) + 1) if not h % d and not w % d)})")
        if p == self.cfg.patch_size:
            if (h, w) != tuple(self.cfg.img_size):
                self.set_resolution(h, w, mode)
            return
        old_grid = self.grid_size
        conv = self.patch_embed.proj
        new = nn.Conv2d(conv.in_channels, conv.out_channels, kernel_size=p, stride=p, bias=conv.bias is not None,
                        device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(resample_patch_embed(conv.weight.detach(), (p, p)))
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        self.patch_embed.proj = new
        self.cfg = self.cfg.replace(patch_size=p)
        self._resample_to(old_grid, h, w, mode)  # one resampling, straight to the new grid
        self.reference = None  # another tokenisation: other embeddings

    def reset_pos_embed(self) -> None:
        """Fresh position embeddings, N(0, 0.02²) as at initialisation (the control of resolution transfer)."""
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    def reset_head(self, num_classes: int, keep_pre_logits: bool = False) -> None:
        """Replace the head with a zero-initialised D x K layer (paper §3.2), dropping pre_logits by default."""
        if not keep_pre_logits:
            self.pre_logits = nn.Identity()
            self.cfg = self.cfg.replace(representation_size=None)
        self.cfg = self.cfg.replace(num_classes=num_classes)
        self.labels = None
        self.reference = None
        self.cfg = self.cfg.replace(embed_norm=False, scores="softmax")  # a new head is an ordinary classifier
        ref = self.patch_embed.proj.weight
        self.head = nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype) \
            if num_classes else nn.Identity()
        self.head_dist = None
        if self.cfg.dist_token and num_classes:
            self.head_dist = nn.Linear(self.cfg.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)
                nn.init.zeros_(head.bias)

    def _pos_embed(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch tokens [B, N, D] -> [B, prefix + N, D]: [class], [dist], registers, patches, plus position
        embeddings (on the patches only when `no_embed_class`, as timm's DINOv2-reg and SigLIP; none without
        absolute position embeddings)."""
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token)
                  if t is not None]
        if self.pos_embed is None:
            return self.pos_drop(torch.cat([*prefix, x], dim=1) if prefix else x)
        pos = self.pos_embed
        if (self.dynamic_size and is_tracing()) or grid != self.grid_size:  # no symbolic compare when tracing
            pos = resample_pos_embed(pos, self.grid_size, grid, self.cfg.num_pos_prefix_tokens,
                                     self.cfg.resample_mode)
        if self.cfg.no_embed_class:
            x = x + pos
            return self.pos_drop(torch.cat([*prefix, x], dim=1) if prefix else x)
        if prefix:
            x = torch.cat([*prefix, x], dim=1)
        return self.pos_drop(x + pos)

    # -- forward --------------------------------------------------------------------------------------
    def forward_stem(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> the first block's input [B, prefix + N, D]: patch embedding, prefix tokens, position
        embeddings, norm_pre."""
        grid = self.check_size(x.shape[-2], x.shape[-1])
        return self.norm_pre(self._pos_embed(self.patch_embed(x), grid))

    def forward_tail(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block's output [B, prefix + N, D] -> (logits [B, K], embedding [B, E]), as
        `forward_embedding` ends without token merging: the encoder runs as stem, blocks, tail (a runner that
        pauses between blocks, `vit_serve.runtime.backends.torch.Stages`)."""
        tokens = self.norm(x)
        embedding = self.embed(self.pool(tokens))
        return self.head_logits(tokens, embedding), embedding

    def rope_tables(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """The rotary table each block reads for input [B, C, H, W] (vit_serve.rope, computed from its patch grid
        with tensor arithmetic only); [None] * depth without RoPE."""
        if self.rope is None:
            return [None] * len(self.blocks)
        table = self.rope(*self.check_size(x.shape[-2], x.shape[-1]))
        return list(table.unbind(0)) if self.rope.freqs is not None else [table] * len(self.blocks)

    def _features(self, x: torch.Tensor, return_attention: bool = False, record: bool = False):
        """forward_features, and the token-merging state (None without ToMe): (tokens, attentions, state);
        `record`: the state keeps each layer's `LayerMerge`."""
        ropes = self.rope_tables(x)
        x = self.forward_stem(x)
        tm = self.token_merging
        merging = tm.start(self.num_prefix_tokens, record) if tm is not None else None
        attentions = []
        for blk, rope in zip(self.blocks, ropes, strict=True):
            if self.grad_checkpointing and self.training and not return_attention and merging is None:
                x, attn = checkpoint(blk, x, False, None, rope, use_reentrant=False)
            else:
                x, attn = blk(x, return_attention, merging, rope)
            if return_attention:
                attentions.append(attn)
        if merging is not None and merging.trace_source and not is_tracing():  # an exported graph keeps no state
            self.tome_source = merging.source
        return self.norm(x), attentions, merging

    def forward_features(self, x: torch.Tensor, return_attention: bool = False):
        """[B, C, H, W] -> tokens [B, prefix + N, D] after the final LayerNorm (and attentions if asked); with
        token merging [B, prefix + N', D], N' the tokens left after the merges."""
        x, attentions, _ = self._features(x, return_attention)
        return (x, attentions) if return_attention else x

    def pool(self, x: torch.Tensor, return_attention: bool = False, size: torch.Tensor | None = None,
             prop_attn: bool = True):
        """Tokens [B, prefix + N, D] -> [B, D]: the [class] token (DeiT: the mean of [class] and [dist]), the
        mean of the patch tokens (GAP), or the attention-pool head (MAP; with return_attention also its
        probabilities [B, heads, 1, N]). `size` [B, prefix + N, 1]: token merging's token sizes, so that GAP
        is the mean over the patches (size-weighted) and MAP attends proportionally (`prop_attn`)."""
        attn = None
        if self.cfg.pool == "token":
            x = (x[:, 0] + x[:, 1]) / 2 if self.cfg.dist_token else x[:, 0]
        elif self.cfg.pool == "map":
            x, attn = self.attn_pool(x, return_attention, size_bias(size) if prop_attn else None)
        elif size is not None:
            p = self.num_prefix_tokens
            x = (x[:, p:] * size[:, p:]).sum(dim=1) / size[:, p:].sum(dim=1)
        else:
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        return (x, attn) if return_attention else x

    def _pool(self, x: torch.Tensor, merging: MergeState | None, return_attention: bool = False):
        """pool() with the token sizes of a forward pass with token merging."""
        if merging is None:
            return self.pool(x, return_attention)
        return self.pool(x, return_attention, merging.size, merging.prop_attn)

    def embed(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled [B, D] -> the image embedding [B, E]: fc_norm (Eva's average-pooled models), pre-logits layer,
        then the projection (CLIP)."""
        x = self.pre_logits(self.fc_norm(pooled))
        return self.proj(x) if self.proj is not None else x

    def head_logits(self, tokens: torch.Tensor, embedding: torch.Tensor):
        """The head on an embedding (L2-normalised first for zero-shot heads); DeiT averages its two heads,
        or returns both while distillation-training."""
        x = F.normalize(embedding, dim=-1) if self.cfg.embed_norm else embedding
        logits = self.head(self.head_drop(x))
        if self.head_dist is None:
            return logits
        dist = self.head_dist(self.head_drop(tokens[:, 1]))
        if self.distilled_training and self.training:
            return self.head(self.head_drop(tokens[:, 0])), dist
        return (self.head(self.head_drop(tokens[:, 0])) + dist) / 2

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens -> logits [B, K], or with pre_logits the image embedding [B, E] (timm's representation)."""
        embedding = self.embed(self.pool(x))
        return self.head_drop(embedding) if pre_logits else self.head_logits(x, embedding)

    def forward_embedding(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C, H, W] -> (logits [B, K], embedding [B, E]) from one pass: the embedding is
        `forward_head(tokens, pre_logits=True)` (each family's own: HF pooler_output for DINOv2 and SigLIP,
        image_embeds for CLIP with projection), the logits the head on it."""
        tokens, _, merging = self._features(x)
        embedding = self.embed(self._pool(tokens, merging))
        return self.head_logits(tokens, embedding), embedding

    # -- NaFlex (SigLIP 2: each image at its own aspect ratio, as padded rows of patches) ----------------
    def forward_patch_features(self, patches: torch.Tensor, spatial_shapes: torch.Tensor,
                               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NaFlex inputs (`vit_serve.naflex.batch_images`): patches [B, M, P * P * C] ((p, q, c) order),
        spatial_shapes [B, 2] (each image's grid h, w; h * w <= M), mask [B, M] (nonzero: a real patch) ->
        (tokens [B, prefix + M, D] after the final LayerNorm, the additive key mask [B, 1, 1, prefix + M]).

        The patch conv as a linear map on flattened patches, the position embeddings resampled per image to its
        own grid (`naflex.position_weights`, transformers' Siglip2VisionEmbeddings), and the key-padding mask in
        every attention, so padded rows never change a real token (their own rows are not meaningful)."""
        if self.patch_embed.backbone is not None or self.token_merging is not None or self.cfg.rope is not None:
            raise ValueError("NaFlex inputs need a plain patch embedding, absolute position embeddings and no "
                             "token merging")
        conv = self.patch_embed.proj
        x = F.linear(patches.to(conv.weight.dtype), naflex.conv_to_linear(conv.weight), conv.bias)
        p, d = self.cfg.num_pos_prefix_tokens, x.shape[-1]
        grid = self.pos_embed[0, p:].reshape(-1, d)
        weights = naflex.position_weights(self.grid_size, spatial_shapes, patches.shape[1])
        x = x + (weights @ grid.float()).to(x.dtype)
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token)
                  if t is not None]
        keep = mask.bool()
        if prefix:
            pre = torch.cat(prefix, dim=1)
            pre = pre if self.cfg.no_embed_class else pre + self.pos_embed[:, :p]
            x = torch.cat([pre, x], dim=1)
            keep = torch.cat([keep.new_ones(keep.shape[0], pre.shape[1]), keep], dim=1)
        bias = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, float("-inf"))
        bias = bias[:, None, None, :]
        x = self.norm_pre(self.pos_drop(x))
        for blk in self.blocks:
            if self.grad_checkpointing and self.training:
                x, _ = checkpoint(blk, x, False, None, None, bias, use_reentrant=False)
            else:
                x, _ = blk(x, mask=bias)
        return self.norm(x), bias

    def forward_patches(self, patches: torch.Tensor, spatial_shapes: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NaFlex inputs (as `forward_patch_features`) -> (logits [B, K], embedding [B, E]), as
        `forward_embedding`: the pool reads real patches only (MAP: the probe's keys masked, HF's
        Siglip2MultiheadAttentionPoolingHead; GAP: the mean over real patches)."""
        tokens, bias = self.forward_patch_features(patches, spatial_shapes, mask)
        if self.cfg.pool == "map":
            pooled = self.attn_pool(tokens, False, bias)[0]
        elif self.cfg.pool == "gap":
            n = self.num_prefix_tokens
            keep = torch.isfinite(bias[:, 0, 0, n:, None]).to(tokens.dtype)
            pooled = (tokens[:, n:] * keep).sum(dim=1) / keep.sum(dim=1)
        else:
            pooled = self.pool(tokens)
        embedding = self.embed(pooled)
        return self.head_logits(tokens, embedding), embedding

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        """[B, C, H, W] -> logits [B, K]; with return_attention, (logits, [attn [B, heads, N, N]] * depth), and
        for MAP models one more entry last: the pool's probe attention [B, heads, 1, N]. With token merging the
        attentions shrink layer by layer ([B, heads, T_l, T_l]); `forward_explain` also says how."""
        if not return_attention:
            feats, _, merging = self._features(x)
            return self.head_logits(feats, self.embed(self._pool(feats, merging)))
        logits, attentions, _ = self.forward_explain(x)
        return logits, attentions

    def forward_explain(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[LayerMerge]]:
        """[B, C, H, W] -> (logits [B, K], attentions as `forward(x, return_attention=True)` gives them, merges):
        with token merging, one `LayerMerge` per layer (its matching, or None, and the token sizes before it),
        so that attention rollout can follow the tokens (`vit_serve.explain.rollout`); without, []."""
        feats, attentions, merging = self._features(x, True, record=True)
        merges = merging.merges if merging is not None else []
        if self.cfg.pool == "map":
            pooled, probe = self._pool(feats, merging, return_attention=True)
            return self.head_logits(feats, self.embed(pooled)), [*attentions, probe], merges
        return self.head_logits(feats, self.embed(self._pool(feats, merging))), attentions, merges


def create_model(name_or_cfg: str | ViTConfig = "B/16", **overrides) -> VisionTransformer:
    """A randomly initialised model from a preset name or a ViTConfig (keyword overrides replace fields)."""
    cfg = get_config(name_or_cfg, **overrides) if isinstance(name_or_cfg, str) else name_or_cfg.replace(**overrides)
    return VisionTransformer(cfg)
