"""What every converter returns, and the one place that turns it into a model (with key checks)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vit_serve.config import ViTConfig
from vit_serve.labels import default_labels
from vit_serve.model import VisionTransformer
from vit_serve.pos_embed import resample_pos_embed
from vit_serve.preprocess import PreprocessConfig
from vit_serve.reference_sketch import Reference


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model; the message says what and where."""


@dataclass
class Converted:
    """A checkpoint in our layout: config, timm-named state dict, labels and preprocessing contract."""

    config: ViTConfig
    state_dict: dict[str, torch.Tensor]
    source: str
    labels: list[str] | None = None
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    reference: Reference | None = None  # our format only: the training data's sketch (vit_serve.monitor)

    def __post_init__(self) -> None:
        if self.labels is None:
            self.labels = default_labels(self.config.num_classes)
        if self.labels is not None and len(self.labels) != self.config.num_classes:
            raise CheckpointError(f"{len(self.labels)} labels for a {self.config.num_classes}-class head")
        if tuple(self.preprocess.input_size) != self.config.img_size:
            self.preprocess = self.preprocess.with_size(*self.config.img_size)


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line (library errors often span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def describe_keys(keys: list[str], limit: int = 12) -> str:
    """A short, comma-separated list of state-dict keys for error messages."""
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str = "") -> None:
    """Raise CheckpointError listing missing, unexpected and mis-shaped keys (never a partial load)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    misshaped = sorted(f"{k} {tuple(state_dict[k].shape)} != model {tuple(v.shape)}"
                       for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape)
    problems = []
    if missing:
        problems.append(f"missing keys: {describe_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {describe_keys(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped keys: {describe_keys(misshaped)}")
    if problems:
        where = f" in {source}" if source else ""
        raise CheckpointError(f"checkpoint{where} does not fit the model: " + "; ".join(problems))


def strip_prefixes(weights: Mapping[str, torch.Tensor], prefixes: Iterable[str]) -> dict[str, torch.Tensor]:
    """`weights` without each of `prefixes` (in turn) that every key carries (training wrappers: DDP, compile)."""
    out = dict(weights)
    for prefix in prefixes:
        if out and all(k.startswith(prefix) for k in out):
            out = {k[len(prefix) :]: v for k, v in out.items()}
    return out


def make_config(fields: dict[str, Any], overrides: Mapping[str, Any], what: str) -> tuple[ViTConfig, ViTConfig]:
    """(config of the checkpoint as stored, config with the overrides applied).

    Raises CheckpointError for fields that do not make a config or overrides that do not fit it, TypeError
    for override names that are not ViTConfig fields.
    """
    try:
        native = ViTConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{what}: {one_line(e)}") from e
    unknown = sorted(set(overrides) - set(ViTConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown ViTConfig override(s): {', '.join(unknown)}")
    try:
        return native, native.replace(**overrides) if overrides else native
    except ValueError as e:
        raise CheckpointError(f"{what}: bad override ({one_line(e)})") from e


def check_against_model(cfg: ViTConfig, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Names and shapes against our model for `cfg`, built on the meta device (no memory, no init cost)."""
    try:
        with torch.device("meta"):
            ref = VisionTransformer(cfg)
    except Exception:  # model code that cannot run on the meta device: build it for real
        ref = VisionTransformer(cfg)
    check_state_dict(ref, state_dict, source)


def resample_to(state_dict: dict[str, torch.Tensor], native: ViTConfig, cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """`state_dict` (of a `native` model) with `pos_embed` [1, prefix + N, D] resampled to `cfg`'s grid.

    The same dict when the image sizes agree; the resize uses `cfg.resample_mode`.
    """
    if cfg.img_size == native.img_size:
        return state_dict
    pos = resample_pos_embed(
        state_dict["pos_embed"], native.grid_size, cfg.grid_size, native.num_pos_prefix_tokens,
        cfg.resample_mode
    )
    return {**state_dict, "pos_embed": pos.contiguous()}


def build_model(conv: Converted) -> VisionTransformer:
    """A ready (eval-mode) model from a converted checkpoint; labels and contract attached to it."""
    with torch.device("meta"):  # no point initialising weights that are about to be replaced
        model = VisionTransformer(conv.config)
    sd = {k: v.to(torch.float32).contiguous() if v.is_floating_point() else v for k, v in conv.state_dict.items()}
    check_state_dict(model, sd, conv.source)
    model.load_state_dict(sd, assign=True)
    model.labels = conv.labels
    model.preprocess_cfg = conv.preprocess
    model.reference = conv.reference
    return model.eval()
