"""What every converter returns, and the one place that turns it into a model (with key checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vit_serve.config import ViTConfig
from vit_serve.labels import default_labels
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig


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


def build_model(conv: Converted) -> VisionTransformer:
    """A ready (eval-mode) model from a converted checkpoint; labels and contract attached to it."""
    with torch.device("meta"):  # no point initialising weights that are about to be replaced
        model = VisionTransformer(conv.config)
    sd = {k: v.to(torch.float32).contiguous() if v.is_floating_point() else v for k, v in conv.state_dict.items()}
    check_state_dict(model, sd, conv.source)
    model.load_state_dict(sd, assign=True)
    model.labels = conv.labels
    model.preprocess_cfg = conv.preprocess
    return model.eval()
