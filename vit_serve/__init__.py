"""vit-serve: the ViT of "An Image is Worth 16x16 Words" — train, export at any resolution, serve.

    import vit_serve
    model = vit_serve.create_model("S/16", num_classes=10)     # random init, paper presets or timm names
    model = vit_serve.load("ViT-B_16.npz")                     # any supported checkpoint, ready to run
    x = vit_serve.preprocess(image, model.preprocess_cfg)      # the one image -> tensor function
    from vit_serve.explain import explain_forward
    e = explain_forward(model, x[None])                        # e.logits, e.heatmap.map (attention rollout)
    vit_serve.save(model, "model.safetensors")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vit_serve.config import ViTConfig, get_config, preset_names
from vit_serve.preprocess import PreprocessConfig, load_image, preprocess, preprocess_batch

if TYPE_CHECKING:
    from vit_serve.model import VisionTransformer

__version__ = "0.1.0"

# Imported on first use, so that `import vit_serve` (and `vit-serve --help`) does not import torch.
_LAZY = {"VisionTransformer": "vit_serve.model", "create_model": "vit_serve.model",
         "resample_pos_embed": "vit_serve.pos_embed"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vit_serve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load(src, arch=None, **overrides) -> VisionTransformer:
    """Any supported checkpoint (file, folder or hub id) -> ready eval-mode model. See vit_serve.checkpoints."""
    from vit_serve.checkpoints import load as _load

    return _load(src, arch=arch, **overrides)


def save(model: VisionTransformer, path, overwrite: bool = False, extra_metadata=None):
    """Save in vit-serve's .safetensors format (config, labels, preprocessing contract), atomically."""
    from vit_serve.checkpoints import save as _save

    return _save(model, path, overwrite=overwrite, extra_metadata=extra_metadata)


__all__ = ["PreprocessConfig", "ViTConfig", "VisionTransformer", "__version__", "create_model", "get_config",
           "load", "load_image", "preprocess", "preprocess_batch", "preset_names", "resample_pos_embed", "save"]
