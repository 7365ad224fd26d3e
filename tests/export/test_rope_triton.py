"""A Triton repository of a RoPE model (DINOv3: rotary tables only, registers), written by
`vit_export.export(formats=("onnx", "triton"))` at a dynamic resolution: parsed with Triton's own model_config
schema, and served by a real tritonserver (as tests/export/test_families_triton.py) whose answer equals timm's own
model (tests/rope_models.py: timm 1.0.31's `Eva`, random weights) at a size the export was not traced at."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.family_models import triton_export
from tests.rope_models import ours_rope, timm_rope

pytest.importorskip("onnxscript")
pytest.importorskip("timm")
pytest.importorskip("tritonclient.http")

TOL = 1e-4
NAME = "dinov3"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    ref = timm_rope("dinov3")
    return ref, triton_export(tmp_path_factory.mktemp("triton_rope"), ours_rope("dinov3", ref), NAME, res="dynamic")


def test_configs_parse_with_triton_s_schema(exported):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    _, repo = exported
    configs = [text_format.Parse(p.read_text(), model_config_pb2.ModelConfig()) for p in repo.glob("*/config.pbtxt")]
    pixels = {c.name: i for c in configs for i in c.input if i.name == "pixel_values"}
    assert f"{NAME}_py" in pixels, sorted(c.name for c in configs)
    for name, inp in pixels.items():
        assert list(inp.dims)[-2:] == [-1, -1], name  # any H x W: the rotary tables come from the input


def test_tritonserver_answers_as_timm_at_an_untraced_size(exported):
    import tritonclient.http as httpclient
    from vit_export.tritonserver import TritonServer, available

    reason = available()
    if reason:
        pytest.skip(reason)
    ref, repo = exported
    x = torch.randn(2, 3, 112, 80, generator=torch.Generator().manual_seed(0))  # traced at 64 x 64
    with torch.no_grad():
        want = ref(x).numpy()
    with TritonServer(repo) as srv:
        assert f"{NAME}_py" in srv.models  # this tritonserver has no onnxruntime backend: the Python one
        client = httpclient.InferenceServerClient(srv.http_address)
        inp = httpclient.InferInput("pixel_values", list(x.shape), "FP32")
        inp.set_data_from_numpy(x.numpy())
        got = client.infer(f"{NAME}_py", [inp], outputs=[httpclient.InferRequestedOutput("logits")])
    err = float(np.abs(got.as_numpy("logits") - want).max())
    print(f"tritonserver {NAME}_py at 112x80: |d logits| {err:.2e}")
    assert err <= TOL
