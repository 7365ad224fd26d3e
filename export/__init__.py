"""vit_export: the export toolkit, installed as `vit_export` (command `vit-export`).

ONNX (static or dynamic resolution, fp32 / fp16 / int8, simplified with onnxslim when outputs stay equal), the
explain graph (logits + attention rollout computed in the graph), parity checks against PyTorch with
onnxruntime, a sidecar file per export, TensorRT engines (CUDA GPU) and the Triton model repository, plus a
launcher for the tritonserver that the nvidia-pytriton wheel ships.
"""
