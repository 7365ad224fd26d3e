"""The contract's `decode` field through `vit-export` (the ONNX sidecar), the gateway's sidecar reader, and the
Triton preprocess model on a real tritonserver (only that model is loaded, to keep the test short).

References: `vit_serve.preprocess` on the fast path (what the Triton model must return bit for bit) and on the
exact one (what it must not return), tritonclient as the client.
"""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import torch

import vit_serve

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import vit_export

from vit_serve.preprocess import PreprocessConfig, preprocess
from vit_serve.runtime.backends.sidecar import read_export

NAME = "tinyfast"
RES = 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory, randomize):
    d = tmp_path_factory.mktemp("decode")
    model = randomize(vit_serve.create_model("Ti/16", num_classes=3, depth=1, img_size=RES), seed=0)
    model.labels = ["a", "b", "c"]
    model.preprocess_cfg = PreprocessConfig(input_size=(RES, RES), decode="fast")
    ckpt = vit_serve.save(model, d / "tiny.safetensors")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        options = vit_export.ExportOptions(formats=("onnx", "triton"), out=d / "out", repo=d / "repo", name=NAME)
        result = vit_export.export(ckpt, options)
    finally:
        torch.set_num_threads(threads)
    assert result.ok and [w.model for w in result.triton][-1] == f"{NAME}_ensemble"
    return {"onnx": d / "out" / f"{NAME}.onnx", "repo": d / "repo", "cfg": model.preprocess_cfg}


def _jpeg() -> bytes:
    import skimage.data
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(skimage.data.coffee()).resize((1200, 800)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_decode_in_the_sidecar_and_read_back_by_the_gateway(exported):
    side = json.loads(exported["onnx"].with_suffix(".json").read_text())
    assert side["preprocess"]["decode"] == "fast"
    info, _ = read_export(exported["onnx"], None, "onnxruntime", "graph")
    assert info.preprocess == exported["cfg"]


def test_a_sidecar_without_the_field_reads_as_exact(exported, tmp_path):
    import shutil

    onnx = tmp_path / f"{NAME}.onnx"
    shutil.copy(exported["onnx"], onnx)
    side = json.loads(exported["onnx"].with_suffix(".json").read_text())
    del side["preprocess"]["decode"]
    onnx.with_suffix(".json").write_text(json.dumps(side))
    info, _ = read_export(onnx, None, "onnxruntime", "graph")
    assert info.preprocess.decode == "exact"


def test_triton_preprocess_model_honours_decode(exported):
    pytest.importorskip("tritonclient.http")
    import tritonclient.http as httpclient
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    from vit_export.tritonserver import TritonServer, available

    config = text_format.Parse((exported["repo"] / f"{NAME}_preprocess" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    assert json.loads(config.parameters["vit_serve"].string_value)["preprocess"]["decode"] == "fast"
    reason = available()
    if reason:
        print(f"skipping the Triton server part: {reason}")
        pytest.skip(reason)
    data = _jpeg()
    fast = preprocess(data, exported["cfg"])
    exact = preprocess(data, exported["cfg"].with_decode("exact"))
    assert not torch.equal(fast, exact)
    srv = TritonServer(exported["repo"], models=[f"{NAME}_preprocess"])
    t0 = time.perf_counter()
    srv.start(timeout=120)
    print(f"tritonserver ready in {time.perf_counter() - t0:.1f}s")
    try:
        client = httpclient.InferenceServerClient(srv.http_address)
        t = httpclient.InferInput("image", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[data]], dtype=object))
        got = client.infer(f"{NAME}_preprocess", [t]).as_numpy("pixel_values")
    finally:
        srv.close()
    assert np.array_equal(got[0], fast.numpy())  # the fast path, bit for bit
