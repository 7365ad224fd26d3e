"""Runs under the python that has KServe's SDK (test_grpc.py starts it in a subprocess): talks to the gateway's
gRPC port with `kserve.InferenceGRPCClient` and prints what it got as one JSON document.

    python kserve_grpc_script.py HOST:PORT MODEL DIR

DIR holds pixels.npy (float32 [B, 3, H, W]) and image_<i>.bin (encoded images). Inference sends the pixels as
raw_input_contents (a numpy input), as typed contents (a list input), and the images as BYTES.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest
from kserve.protocol.infer_type import RequestedOutput


def _outputs(response) -> dict[str, dict]:
    return {o.name: {"datatype": o.datatype, "shape": list(o.shape), "data": o.as_numpy().ravel().tolist()}
            for o in response.outputs}


async def main(address: str, model: str, folder: Path) -> dict:
    pixels = np.load(folder / "pixels.npy")
    images = [p.read_bytes() for p in sorted(folder.glob("image_*.bin"))]
    got: dict = {}
    async with InferenceGRPCClient(address, timeout=60) as client:

        async def step(key: str, call) -> None:
            """got[key] = what the call returned, or {"exception", "code", "details"}."""
            try:
                got[key] = await call
            except Exception as e:  # reported to the test, which fails on it
                code = e.code().name if isinstance(e, grpc.RpcError) else None
                details = e.details() if isinstance(e, grpc.RpcError) else None
                got[key] = {"exception": f"{type(e).__name__}: {e}", "code": code, "details": details}

        async def infer(inputs, name: str = model) -> dict:
            request = InferRequest(name, inputs, request_outputs=[RequestedOutput("logits")])
            return _outputs(await client.infer(request))

        raw = InferInput("pixel_values", list(pixels.shape), "FP32")
        raw.set_data_from_numpy(pixels)
        typed = InferInput("pixel_values", list(pixels.shape), "FP32", data=pixels.ravel().tolist())
        image = InferInput("image", [len(images)], "BYTES")
        image.set_data_from_numpy(np.array(images, dtype=np.object_))
        await step("server_live", client.is_server_live())
        await step("server_ready", client.is_server_ready())
        await step("model_ready", client.is_model_ready(model))
        await step("raw", infer([raw]))
        await step("typed", infer([typed]))
        await step("images", infer([image]))
        await step("unknown_model", infer([raw], name="other"))
    return got


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))))
