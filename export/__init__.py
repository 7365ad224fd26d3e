"""vit_export: the export toolkit, installed as `vit_export` (command `vit-export`).

    import vit_export
    result = vit_export.export("model.safetensors", vit_export.ExportOptions(res=384, formats=("onnx", "triton")))

`export` (`vit_export.pipeline`) is the whole pipeline as one call; the command only parses its flags into
`ExportOptions` and prints. ONNX (static or dynamic resolution, fp32 / fp16 / int8, simplified with onnxslim when
outputs stay equal), the explain graph (logits + attention rollout computed in the graph), parity checks against
PyTorch with onnxruntime, a manifest per export, TensorRT engines (CUDA GPU) and the Triton model repository, plus
a launcher for the tritonserver that the nvidia-pytriton wheel ships.
"""

from typing import Any

__all__ = ["ExportOptions", "ExportResult", "OptionError", "OutputExistsError", "export"]


def __getattr__(name: str) -> Any:  # lazy: `import vit_export` needs neither torch nor onnx until they are used
    if name in __all__:
        from vit_export import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'vit_export' has no attribute {name!r}")
