"""vit_export: the export toolkit, installed as `vit_export` (command `vit-export`).

    import vit_export
    result = vit_export.export("model.safetensors", vit_export.ExportOptions(res=384, formats=("onnx", "triton")))

`export` (`vit_export.pipeline`) is the whole pipeline as one call; the command only parses its flags into
`ExportOptions` and prints. ONNX (static or dynamic resolution, fp32 / fp16 / int8, simplified with onnxslim when
outputs stay equal), the explain graph (logits + attention rollout computed in the graph), parity checks against
PyTorch with onnxruntime, a manifest per export, TensorRT engines (CUDA GPU) and the Triton model repository, plus
a launcher for the tritonserver that the nvidia-pytriton wheel ships.
"""

from vit_export.pipeline import ExportOptions, ExportResult, OptionError, OutputExistsError, export

__all__ = ["ExportOptions", "ExportResult", "OptionError", "OutputExistsError", "export"]
