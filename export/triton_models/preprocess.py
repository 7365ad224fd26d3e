"""Triton Python-backend model: encoded image bytes -> pixel_values, through `vit_serve.preprocess.preprocess`.

Input "image" [B, 1] TYPE_STRING (JPEG, PNG, ... bytes); output "pixel_values" [B, 3, H, W] float32, with the
preprocessing contract (size, mean/std, interpolation, crop, and the decode path "exact" | "fast", which
`preprocess` honours) stored in the config parameter "vit_serve" (`vit_serve.manifest.TritonMeta`). A request holding an
image that cannot be decoded (or is over "max_pixels") gets an INVALID_ARG error;
the other requests of the batch are answered normally.
"""

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from vit_serve.manifest import PIXEL_VALUES, TritonMeta
from vit_serve.preprocess import preprocess

INPUT, OUTPUT = "image", PIXEL_VALUES


def _invalid(message: str):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        self.cfg = TritonMeta.from_config(config, args.get("model_name", "preprocess")).preprocess
        max_pixels = int(params.get("max_pixels", {}).get("string_value", "0"))
        self.max_pixels = max_pixels or None
        torch.set_num_threads(1)

    def _one(self, request) -> np.ndarray:
        images = pb_utils.get_input_tensor_by_name(request, INPUT).as_numpy().reshape(-1)
        return np.stack([preprocess(bytes(b), self.cfg, self.max_pixels).numpy() for b in images])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                x = self._one(request)
            except (ValueError, TypeError) as e:  # ImageDecodeError / ImageTooLargeError: this request only
                responses.append(pb_utils.InferenceResponse(error=_invalid(" ".join(str(e).split()))))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(OUTPUT, x)]))
        return responses
