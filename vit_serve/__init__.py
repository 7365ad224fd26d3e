"""vit-serve: the ViT of "An Image is Worth 16x16 Words" — train, export at any resolution, serve.

    import vit_serve
    model = vit_serve.create_model("S/16", num_classes=10)     # random init, paper presets or timm names
    model = vit_serve.load("ViT-B_16.npz")                     # any supported checkpoint, ready to run
    x = vit_serve.preprocess(image, model.preprocess_cfg)      # the one image -> tensor function
    from vit_serve.explain import explain_forward
    e = explain_forward(model, x[None])                        # e.logits, e.heatmap.map (attention rollout)
    vit_serve.save(model, "model.safetensors")
"""

from vit_serve.config import ViTConfig, get_config, preset_names
from vit_serve.model import VisionTransformer, create_model
from vit_serve.pos_embed import resample_pos_embed
from vit_serve.preprocess import PreprocessConfig, load_image, preprocess, preprocess_batch

__version__ = "0.1.0"


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
