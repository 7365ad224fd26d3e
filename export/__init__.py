"""vit_export: the export toolkit (ONNX, TensorRT, Triton model repository), installed as `vit_export`.

The exporters themselves are tracked by the export issue; this release ships the package and its command.
"""
