"""vit-serve: the ViT of "An Image is Worth 16x16 Words" — train, export at any resolution, serve.

    import vit_serve
    model = vit_serve.create_model("S/16", num_classes=10)     # random init, paper presets or timm names
    model = vit_serve.load("ViT-B_16.npz")                     # any supported checkpoint, ready to run
    x = vit_serve.preprocess(image, model.preprocess_cfg)      # the one image -> tensor function
    from vit_serve.explain import explain_forward
    e = explain_forward(model, x[None])                        # e.logits, e.heatmap.map (attention rollout)
    vit_serve.save(model, "model.safetensors")

`import vit_serve` does not import torch until a model is made (`vit-serve --help` stays light). The package:

- `config`, `model`, `resnet`: the architecture (`ViTConfig` and the presets; the `VisionTransformer`; the hybrids'
  BiT ResNet stem).
- `pos_embed`, `resolution`: position-embedding resampling (paper §3.2) and resolutions as people write them.
- `naflex`: SigLIP 2's NaFlex inputs (each image at its aspect ratio, as padded rows of patches with a mask).
- `rope`: 2-D rotary position embeddings (EVA-02, PE, DINOv3, RoPE-ViT): sin / cos tables from the patch grid.
- `preprocess`: image -> tensor and the preprocessing contract stored with the weights.
- `explain`, `rollout_options`, `overlay`: attention rollout and the other inspections' math, the rollout's
  options, the heat-map overlay drawn on the model-input crop.
- `similarity`: why an image matched a query (its cosine split over the patches), and any block's patch tokens.
- `inspect`: `vit-serve inspect`, the paper's Figure 6 / 7 pictures.
- `tome`: token merging (ToMe).
- `tome_schedule`: how many tokens each layer merges (plain Python, no torch).
- `embedding`, `zeroshot`: the image embedding; zero-shot heads from label text (CLIP, SigLIP).
- `fingerprint`: the embedding space's identity (a hash of the weights and of all that moves the vectors).
- `monitor`, `reference`, `reference_sketch`: OOD scores and drift; a model's reference built from images; the
  record checkpoints and manifests carry.
- `manifest`: the export manifest every reader reads.
- `accuracy_bounds`: how close bf16, fp16 and int8 must stay to fp32 (top-1 agreement, cosine), measured.
- `tensorrt_engine`: a serialized TensorRT engine run on torch CUDA buffers.
- `signal_stack`: the thread's alternate signal stack, kept across OpenVINO's compiles (which unmap theirs).
- `data`: data sets (the embedded digits, image folders, CIFAR) and their loaders.
- `quickstart`: `vit-serve quickstart`, train -> fine-tune at 2x -> export -> serve.
- `flag`, `cli_parser`: how a typed field is spelled as a flag; the one-line-error argument parser.
- `checkpoints/`: our safetensors format and a converter per source format.
- `text/`: text towers and tokenizers for zero-shot heads.
- `train/`: the training loop, its recipes and evaluation.
- `runtime/`: what serving a model needs, without a web framework (backends, scheduling, decode).
- `serve/`: the gateway (FastAPI, gRPC) and the web page.
- `predict/`: offline batch prediction over image files.
- `tune/`: `vit-serve tune`, the fastest gateway settings within a latency target.
- `deploy/`: the gateway on Ray Serve.
- `cli/`: the `vit-serve` command.
- `labels/`: class-name files (ImageNet-1k).
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
