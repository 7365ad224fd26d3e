"""Triton Python-backend model templates, copied by `vit_export.triton_repo` into `<model>/<version>/model.py`.

- `onnx_classifier`: pixel_values [B, 3, H, W] -> the ONNX graph's outputs (logits [B, K], and rollout
  [B, gh, gw] for the explain graph), one onnxruntime session run per batch of requests.
- `preprocess`: image [B, 1] (encoded bytes) -> pixel_values [B, 3, H, W] through
  `vit_serve.preprocess.preprocess` and the contract stored in the model's config.

They run inside Triton's Python backend stub (`triton_python_backend_utils` exists only there), so they are
never imported here; the writer reads their text.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES = ("onnx_classifier", "preprocess")


def template_text(name: str) -> str:
    """The source of the template `name` (one of TEMPLATES)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown Triton model template {name!r}; expected one of {', '.join(TEMPLATES)}")
    return (Path(__file__).parent / f"{name}.py").read_text()
