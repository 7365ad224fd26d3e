"""The `onnx` Triton ensemble (`vit-export --triton-ensemble onnx`, the default without an engine).

The tritonserver bundled in nvidia-pytriton has only the Python backend, so Triton's onnxruntime backend and the
ensemble scheduler over it cannot run here. What can run is checked against things this project did not write:
- Triton's own config schema (`tritonclient.grpc.model_config_pb2`) and the rules its ensemble scheduler and
  onnxruntime backend apply when they load a repository: every step's mapped tensors exist in that step's
  config, each ensemble tensor has one producer and agrees in type and shape with its consumers, and the
  onnxruntime config's inputs and outputs are the ONNX graph's own (names, element types, dims after the batch
  axis);
- the data path the scheduler would run, on the real parts: the real tritonserver's `NAME_preprocess` model
  turns JPEG/PNG bytes into `pixel_values`, and onnxruntime runs `NAME_onnx/1/model.onnx` on them as the
  backend would, compared with PyTorch on `vit_serve.preprocess`.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import vit_serve

pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.grpc")

import onnx
import onnxruntime as ort
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb
from vit_export.tritonserver import TritonServer, available

from vit_serve.preprocess import preprocess

NAME = "ens"
RES = 64
LABELS = [f"class_{i}" for i in range(7)]
# Triton's TYPE_* for the ONNX element types the export uses (onnxruntime backend's mapping).
ONNX_TO_TRITON = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16"}


def _config(repo, model: str):
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), pb.ModelConfig())


def _tensors(ts) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (pb.DataType.Name(t.data_type), tuple(t.dims)) for t in ts}


@pytest.fixture(scope="module")
def repo(tmp_path_factory, export_tiny):
    d = tmp_path_factory.mktemp("onnx_ensemble")
    result, ckpt = export_tiny(d, RES, 3, LABELS, formats=("onnx", "triton"), out=d / "exports", repo=d / "repo",
                               name=NAME)
    assert result.ok
    return {"repo": d / "repo", "model": vit_serve.load(ckpt)}


def test_the_default_ensemble_calls_the_onnxruntime_model(repo):
    ens = _config(repo["repo"], f"{NAME}_ensemble")
    assert ens.platform == "ensemble"
    assert [s.model_name for s in ens.ensemble_scheduling.step] == [f"{NAME}_preprocess", f"{NAME}_onnx"]
    assert _config(repo["repo"], f"{NAME}_onnx").platform == "onnxruntime_onnx"


def test_every_mapped_tensor_exists_with_one_producer_and_agreeing_types(repo):
    root = repo["repo"]
    ens = _config(root, f"{NAME}_ensemble")
    # Ensemble tensors: the ensemble's inputs are produced by the request; each step output by exactly one step.
    produced = {name: spec for name, spec in _tensors(ens.input).items()}
    for step in ens.ensemble_scheduling.step:
        cfg = _config(root, step.model_name)
        assert cfg.max_batch_size >= ens.max_batch_size > 0, step.model_name  # the scheduler batches through
        ins, outs = _tensors(cfg.input), _tensors(cfg.output)
        for model_input, tensor in step.input_map.items():
            assert model_input in ins, f"{step.model_name} has no input {model_input!r}"
            assert tensor in produced, f"{tensor!r} is consumed by {step.model_name} before anything produces it"
            want_type, want_dims = ins[model_input]
            got_type, got_dims = produced[tensor]
            assert got_type == want_type, (tensor, got_type, want_type)
            assert len(got_dims) == len(want_dims) and all(
                g == w or -1 in (g, w) for g, w in zip(got_dims, want_dims, strict=True)), (tensor, got_dims, want_dims)
        assert set(step.input_map) == set(ins), f"{step.model_name}: unmapped inputs {set(ins) - set(step.input_map)}"
        for model_output, tensor in step.output_map.items():
            assert model_output in outs, f"{step.model_name} has no output {model_output!r}"
            assert tensor not in produced, f"{tensor!r} has two producers"
            produced[tensor] = outs[model_output]
    for name, (dtype, dims) in _tensors(ens.output).items():
        assert name in produced, f"ensemble output {name!r} is never produced"
        assert produced[name] == (dtype, dims)


def test_the_onnxruntime_config_is_the_graphs_own(repo):
    root = repo["repo"]
    cfg = _config(root, f"{NAME}_onnx")
    graph = onnx.load(root / f"{NAME}_onnx" / "1" / "model.onnx").graph

    def spec(values) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for v in values:
            shape = v.type.tensor_type.shape.dim
            assert shape[0].dim_param or shape[0].dim_value == 0, f"{v.name}: batch axis must be dynamic"
            dims = tuple(d.dim_value if d.dim_value else -1 for d in shape[1:])
            out[v.name] = (ONNX_TO_TRITON[v.type.tensor_type.elem_type], dims)
        return out

    assert _tensors(cfg.input) == spec(graph.input)
    assert _tensors(cfg.output) == spec(graph.output)


def _encode(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def test_the_data_path_on_the_real_parts(repo):
    """Bytes -> the real tritonserver's preprocess model -> the ensemble's onnxruntime model in onnxruntime, as the
    scheduler would chain them, against PyTorch on vit_serve.preprocess."""
    reason = available()
    if reason:
        pytest.skip(reason)
    root = repo["repo"]
    data = pytest.importorskip("skimage.data")
    payloads = [_encode(data.coffee(), "JPEG"), _encode(data.astronaut()[:200, :300], "PNG")]
    with TritonServer(root, models=[f"{NAME}_preprocess"]) as server:  # started on entry
        client = httpclient.InferenceServerClient(server.http_address)
        t = httpclient.InferInput("image", [len(payloads), 1], "BYTES")
        t.set_data_from_numpy(np.array([[p] for p in payloads], dtype=object))
        pixels = client.infer(f"{NAME}_preprocess", [t]).as_numpy("pixel_values")
    cfg = _config(root, f"{NAME}_onnx")
    sess = ort.InferenceSession(str(root / f"{NAME}_onnx" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = sess.run([cfg.output[0].name], {cfg.input[0].name: pixels})
    model = repo["model"].eval()
    with torch.no_grad():
        ref = model(torch.stack([preprocess(p, model.preprocess_cfg) for p in payloads])).numpy()
    err = float(np.abs(logits - ref).max())
    print(f"onnx ensemble data path (tritonserver preprocess -> onnxruntime) vs PyTorch max|Δ| = {err:.2e}")
    assert logits.shape == (len(payloads), len(LABELS)) and err < 1e-4
    assert (logits.argmax(1) == ref.argmax(1)).all()
