"""vit_export: the export toolkit, installed as `vit_export` (command `vit-export`).

    import vit_export
    result = vit_export.export("model.safetensors", vit_export.ExportOptions(res=384, formats=("onnx", "triton")))

`export` (`vit_export.pipeline`) is the whole pipeline as one call; the command only parses its flags into
`ExportOptions` and prints. `import vit_export` needs neither torch nor onnx until they are used.

- `pipeline`: `export(model, options) -> ExportResult`, every step in order.
- `cli`: the `vit-export` command.
- `onnx_export`, `graph_info`: the ONNX graphs (static or dynamic resolution; the explain graph computes the
  rollout in the graph) and what a graph says about itself.
- `graph_ops`: what a graph is made of (its op counts) and whether its size arithmetic is plain (no If / Loop,
  every Range bounded by a Shape), as TensorRT's dynamic profiles need.
- `simplify`: onnxslim, kept only when outputs stay equal.
- `parity`: the export against PyTorch, with onnxruntime.
- `quantize`: int8 (dynamic or static) and what it costs and gains.
- `openvino_ir`: the OpenVINO IR of both graphs (`--format openvino`), int8 by NNCF, and what int8 costs.
- `sidecar`: the manifest written beside every export.
- `text_tower`: a checkpoint's text tower as its own graph.
- `naflex_graph`: a SigLIP 2 NaFlex model's patch graph (patches, spatial shapes, mask), any batch and budget.
- `tensorrt_build`, `tensorrt_compat`, `typed_graph`: TensorRT engines (a CUDA GPU), what each TensorRT version
  needs, fp16 / bf16-typed graphs for them.
- `triton_repo`, `triton_config`, `triton_models/`: the Triton model repository, its config.pbtxt files, its
  Python-backend model templates.
- `tritonserver`: a launcher for the tritonserver that the nvidia-pytriton wheel ships (in none of vit-serve's
  runtime extras; its `test` extra has it).
- `memory`, `proto_file`: memory handed back between steps; an ONNX model written without serializing it whole.
"""

from typing import Any

__all__ = ["ExportOptions", "ExportResult", "OptionError", "OutputExistsError", "export"]


def __getattr__(name: str) -> Any:  # lazy: `import vit_export` needs neither torch nor onnx until they are used
    if name in __all__:
        from vit_export import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'vit_export' has no attribute {name!r}")
