"""Runs under the python that has KServe's SDK (test_kserve_client.py starts it in a subprocess): talks to the
gateway with `kserve.InferenceRESTClient(RESTConfig(protocol="v2"))` and prints what it got as one JSON document.

    python kserve_client_script.py BASE_URL MODEL DIR

DIR holds pixels.npy (float32 [B, 3, H, W]) and image_<i>.bin (encoded images). Health, model readiness and
inference go through the SDK's client; the metadata documents (the REST client has no call for them) are fetched
with httpx, the SDK's own HTTP library, and validated with the SDK's v2 data models.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from pathlib import Path

import httpx
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput
from kserve.protocol.rest.v2_datamodels import (
    ModelMetadataResponse,
    ModelReadyResponse,
    ServerLiveResponse,
    ServerMetadataResponse,
    ServerReadyResponse,
)


def _input(name: str, datatype: str, array: np.ndarray, binary: bool) -> InferInput:
    inp = InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array, binary_data=binary)
    return inp


def _outputs(response) -> dict[str, dict]:
    out = {}
    for o in response.outputs:
        arr = o.as_numpy()
        data = [x.decode() if isinstance(x, bytes) else x for x in arr.ravel().tolist()]
        out[o.name] = {"datatype": o.datatype, "shape": list(o.shape), "data": data}
    return out


async def main(url: str, model: str, folder: Path) -> dict:
    pixels = np.load(folder / "pixels.npy")
    images = [p.read_bytes() for p in sorted(folder.glob("image_*.bin"))]
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    got: dict = {}

    async def step(key: str, call) -> None:
        """got[key] = what the call returned, or {"exception": ...} (so that each test names its own failure)."""
        try:
            got[key] = await call
        except Exception as e:  # reported to the test, which fails on it
            status = e.response.status_code if isinstance(e, httpx.HTTPStatusError) else None
            got[key] = {"exception": f"{type(e).__name__}: {e}", "status": status}

    async def infer(inputs, outputs=None, parameters=None, request_id=None) -> dict:
        request = InferRequest(model, inputs, request_id=request_id, request_outputs=outputs, parameters=parameters)
        return _outputs(await client.infer(url, request, model_name=model))

    async def document(address: str, schema) -> dict:
        async with httpx.AsyncClient(timeout=60) as http:
            return schema.model_validate((await http.get(address)).json()).model_dump()

    try:
        await step("server_live", client.is_server_live(url))
        await step("server_ready", client.is_server_ready(url))
        await step("model_ready", client.is_model_ready(url, model))
        await step("other_model_ready", client.is_model_ready(url, "other"))
        await step("live", document(f"{url}/v2/health/live", ServerLiveResponse))
        await step("ready", document(f"{url}/v2/health/ready", ServerReadyResponse))
        await step("model_ready_body", document(f"{url}/v2/models/{model}/ready", ModelReadyResponse))
        await step("server_metadata", document(f"{url}/v2", ServerMetadataResponse))
        await step("model_metadata", document(f"{url}/v2/models/{model}", ModelMetadataResponse))
        await step("json", infer([_input("pixel_values", "FP32", pixels, False)], [RequestedOutput("logits")],
                                 request_id="k1"))
        await step("binary", infer([_input("pixel_values", "FP32", pixels, True)],
                                   [RequestedOutput("logits", {"binary_data": True})]))
        await step("all_outputs_binary", infer([_input("pixel_values", "FP32", pixels, True)],
                                               parameters={"binary_data_output": True}))
        await step("images_binary", infer([_input("image", "BYTES", np.array(images, dtype=np.object_), True)],
                                          [RequestedOutput("logits", {"binary_data": True})]))
        # JSON BYTES elements are UTF-8 strings: the images travel base64-encoded, as the gateway reads them.
        b64 = np.array([base64.b64encode(b) for b in images], dtype=np.object_)
        await step("images_json", infer([_input("image", "BYTES", b64, False)], [RequestedOutput("logits")]))
        await step("classification", infer([_input("pixel_values", "FP32", pixels, True)],
                                           [RequestedOutput("logits", {"classification": 3})]))
        await step("unknown_output", infer([_input("pixel_values", "FP32", pixels, False)],
                                           [RequestedOutput("probs")]))
    finally:
        await client.close()
    return got

if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))))
