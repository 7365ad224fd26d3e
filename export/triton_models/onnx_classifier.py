"""Triton Python-backend model: an exported vit-serve ONNX graph run with onnxruntime (CPU).

Input "pixel_values" [B, 3, H, W] float32; outputs the graph's ("logits" [B, K], and "rollout" [B, gh, gw] for
the explain graph). Triton's dynamic batcher hands `execute` several requests at once; they are concatenated
along the batch axis, run as ONE session call, and split back per request.

Config parameters: "intra_op_num_threads" (default 1). The ONNX file is `<version>/model.onnx`. The tensor names
are the config's (this file imports nothing of vit-serve: it runs in any Python backend with onnxruntime).
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


def _param(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.input = config["input"][0]["name"]
        self.outputs = [o["name"] for o in config["output"]]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(_param(config, "intra_op_num_threads", "1"))
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])

    def execute(self, requests: list) -> list:
        arrays = [pb_utils.get_input_tensor_by_name(r, self.input).as_numpy() for r in requests]
        try:
            outs = self.session.run(self.outputs, {self.input: np.concatenate(arrays)})
        except Exception as e:  # the whole batch failed in onnxruntime: every request gets the message
            error = pb_utils.TritonError(f"onnxruntime: {' '.join(str(e).split())}")
            return [pb_utils.InferenceResponse(error=error) for _ in requests]
        bounds = np.cumsum([a.shape[0] for a in arrays])[:-1]
        per_request = zip(*(np.split(o, bounds) for o in outs), strict=True)  # [(logits_i, rollout_i), ...]
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(n, a) for n, a in zip(self.outputs, arrays_i, strict=True)])
            for arrays_i in per_request
        ]
