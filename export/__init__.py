"""vit_export: the export toolkit, installed as `vit_export` (command `vit-export`).

This release: ONNX (static or dynamic resolution, fp32 / fp16 / int8), the explain graph (logits + attention
rollout computed in the graph), parity checks against PyTorch with onnxruntime, and a sidecar file per export.
TensorRT engines and the Triton model repository are not built yet.
"""
