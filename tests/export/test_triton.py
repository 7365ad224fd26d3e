"""The Triton model repository (vit_export.triton_repo) served by a real tritonserver (vit_export.tritonserver).

References: onnxruntime on the exported ONNX file (what the Python-backend models must reproduce exactly),
the PyTorch model and `vit_serve.explain.rollout` (what the export must mean), `vit_serve.preprocess` (the one
preprocessing function), and Triton's own model_config schema (`tritonclient.grpc.model_config_pb2`).
One server per module, on the Python-backend models of a tiny random ViT (Ti/16, depth 2, 64x64, 10 classes).
"""

from __future__ import annotations

import functools
import io
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import vit_serve

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import vit_export
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException
from vit_export.parity import session
from vit_export.triton_repo import write_repository
from vit_export.tritonserver import TritonServer, available

from vit_serve.explain import rollout
from vit_serve.manifest import file_sha256
from vit_serve.preprocess import preprocess

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
NAME = "tiny"
RES = 64


def _encode(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_tiny):
    """`vit_export.export` with formats onnx, triton, tensorrt of a tiny ViT with real labels (the ensemble calls
    `_py`)."""
    d = tmp_path_factory.mktemp("triton")
    # A 20 ms batching window: concurrent requests share executions even on a busy 2-core box.
    result, ckpt = export_tiny(d, RES, 0, LABELS, formats=("onnx", "triton", "tensorrt"), out=d / "exports",
                               repo=d / "repo", name=NAME, triton_ensemble="py", queue_delay_us=20000)
    out = d / "exports"
    return {
        "dir": d,
        "result": result,
        "repo": d / "repo",
        "onnx": out / f"{NAME}.onnx",
        "explain": out / f"{NAME}_explain.onnx",
        "model": vit_serve.load(ckpt),
    }


@pytest.fixture(scope="module")
def server(exported):
    reason = available()
    if reason:
        print(f"skipping the Triton server tests: {reason}")
        pytest.skip(reason)
    srv = TritonServer(exported["repo"])
    t0 = time.perf_counter()
    srv.start(timeout=120)
    print(f"tritonserver ready in {time.perf_counter() - t0:.1f}s with {srv.models}")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def clients(server):
    return {
        "http": httpclient.InferenceServerClient(server.http_address),
        "grpc": grpcclient.InferenceServerClient(server.grpc_url),
    }


def _infer(client, model: str, inputs: dict[str, np.ndarray], class_count: int = 0):
    mod = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    infer_inputs = []
    for name, value in inputs.items():
        t = mod.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "FP32")
        t.set_data_from_numpy(value)
        infer_inputs.append(t)
    outputs = [mod.InferRequestedOutput("logits", class_count=class_count)] if class_count else None
    return client.infer(model, infer_inputs, outputs=outputs)


def _metrics(server, model: str) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    out = {}
    for key in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_request_success"):
        m = re.search(rf'^{key}{{model="{model}",version="\d+"}} (\S+)$', text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def _parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


# --------------------------------------------------------------------------------------------------------
# The repository on disk
# --------------------------------------------------------------------------------------------------------


def test_export_writes_every_model_and_reports_missing_tensorrt(exported):
    from vit_export.tensorrt_build import unavailable_reason

    repo, result = exported["repo"], exported["result"]
    names = {p.name for p in repo.iterdir()}
    assert {f"{NAME}_{k}" for k in ("onnx", "explain_onnx", "py", "explain_py", "preprocess", "ensemble")} <= names
    leftovers = [p.name for p in (*repo.iterdir(), *exported["dir"].iterdir()) if p.name.startswith(".")]
    assert not leftovers  # the staging folders were renamed into place
    assert result.ok and {(w.model, w.version, w.path) for w in result.triton} == {
        (n, 1, repo / n / "1") for n in names}
    if unavailable_reason():  # no tensorrt / no GPU here: the reason (the CLI's exit code 3), everything else written
        assert result.tensorrt_unavailable == unavailable_reason() and result.engine is None
        assert f"{NAME}_trt" not in names
    else:
        assert result.tensorrt_unavailable is None and result.engine_ok and (repo / f"{NAME}_trt" / "1").is_dir()
    assert (result.onnx, result.explain_onnx) == (exported["onnx"], exported["explain"])
    assert exported["onnx"].is_file() and exported["explain"].is_file()  # the ONNX files stay in `out`


def test_every_config_parses_against_tritons_schema(exported, tmp_path):
    repo = exported["repo"]
    side = json.loads(exported["onnx"].with_suffix(".json").read_text())
    configs = {p.parent.name: _parse(p) for p in repo.glob("*/config.pbtxt")}
    assert len(configs) >= 6
    onnx = configs[f"{NAME}_onnx"]
    assert onnx.platform == "onnxruntime_onnx" and onnx.max_batch_size == 16
    assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in onnx.input] == [
        ("pixel_values", "TYPE_FP32", [3, RES, RES])
    ]
    assert [(o.name, list(o.dims), o.label_filename) for o in onnx.output] == [("logits", [10], "labels.txt")]
    assert (repo / f"{NAME}_onnx" / "labels.txt").read_text().splitlines() == LABELS
    assert (repo / f"{NAME}_onnx" / "1" / "model.onnx").read_bytes() == exported["onnx"].read_bytes()
    explain = configs[f"{NAME}_explain_onnx"]
    assert [(o.name, list(o.dims)) for o in explain.output] == [("logits", [10]), ("rollout", [RES // 16] * 2)]
    for name in (f"{NAME}_onnx", f"{NAME}_py", f"{NAME}_explain_py", f"{NAME}_preprocess"):
        cfg = configs[name]
        db = cfg.dynamic_batching
        assert list(db.preferred_batch_size) == [8, 16] and db.max_queue_delay_microseconds == 20000
        assert db.default_queue_policy.max_queue_size == 128
        assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, model_config_pb2.ModelInstanceGroup.KIND_CPU)]
        assert cfg.model_warmup, name
    assert configs[f"{NAME}_py"].backend == "python"
    warm = configs[f"{NAME}_preprocess"].model_warmup[0].inputs["image"]
    assert warm.input_data_file == "image.bin" and (repo / f"{NAME}_preprocess" / "warmup" / "image.bin").is_file()
    meta = json.loads(onnx.parameters["vit_serve"].string_value)
    assert meta["resolution"] == [RES, RES] and meta["patch_size"] == 16 and meta["labels"] == LABELS
    assert meta["preprocess"] == side["preprocess"] and meta["explain_model"] == f"{NAME}_explain_onnx"
    assert meta["rollout"] == {"head_fusion": "mean", "discard_ratio": 0.9, "pool": "token", "num_prefix_tokens": 1}
    assert meta["sidecar_sha256"] == file_sha256(exported["onnx"].with_suffix(".json"))
    ens = configs[f"{NAME}_ensemble"]
    assert ens.platform == "ensemble" and [s.model_name for s in ens.ensemble_scheduling.step] == [
        f"{NAME}_preprocess",
        f"{NAME}_py",
    ]
    assert ens.output[0].label_filename == "labels.txt"

    # A tensorrt_plan config, written from a stand-in engine file: checked against the schema only (no GPU here).
    fake = tmp_path / "model_sm90.plan"
    fake.write_bytes(b"not an engine: schema check only")
    engine = {"path": fake, "compute_capability": "9.0", "file": "model_sm90.plan", "batch": (1, 8, 16)}
    write_repository(exported["onnx"], exported["explain"], tmp_path / "repo", NAME, engine)
    trt = _parse(tmp_path / "repo" / f"{NAME}_trt" / "config.pbtxt")
    assert trt.platform == "tensorrt_plan" and dict(trt.cc_model_filenames) == {"9.0": "model_sm90.plan"}
    assert trt.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (tmp_path / "repo" / f"{NAME}_trt" / "1" / "model_sm90.plan").is_file()
    ens = _parse(tmp_path / "repo" / f"{NAME}_ensemble" / "config.pbtxt")
    assert ens.ensemble_scheduling.step[1].model_name == f"{NAME}_trt"  # default target with an engine


def test_reexport_adds_a_version_and_keeps_the_first(exported, tmp_path):
    repo = tmp_path / "repo"
    write_repository(exported["onnx"], exported["explain"], repo, NAME)
    first = {p: p.read_bytes() for p in repo.glob("*/1/*")}
    stamps = {p: p.stat().st_mtime_ns for p in first}
    written = write_repository(exported["onnx"], exported["explain"], repo, NAME)
    assert {w.version for w in written} == {2} and len(written) == 6
    for w in written:
        assert w.path == repo / w.model / "2" and w.path.is_dir()
    assert {p: p.read_bytes() for p in repo.glob("*/1/*")} == first
    assert {p: p.stat().st_mtime_ns for p in first} == stamps
    assert (repo / f"{NAME}_py" / "2" / "model.onnx").read_bytes() == exported["onnx"].read_bytes()


def test_other_resolution_under_the_same_name_is_refused(exported):
    """A 32x32 export named like the 64x64 one: a ValueError naming both, and nothing added to the repository."""
    d, repo = exported["dir"], exported["repo"]
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    options = vit_export.ExportOptions(res=32, formats=("triton",), out=d / "exports32", repo=repo, name=NAME)
    with pytest.raises(ValueError, match="other inputs/outputs") as info:
        vit_export.export(d / "tiny.safetensors", options)
    assert "pixel_values FP32[3, 32, 32]" in str(info.value) and "--name" in str(info.value)
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before


# --------------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_python_model_logits_equal_onnxruntime(exported, clients, protocol):
    x = torch.randn(5, 3, RES, RES, generator=torch.Generator().manual_seed(1)).numpy()
    got = _infer(clients[protocol], f"{NAME}_py", {"pixel_values": x}).as_numpy("logits")
    want = session(exported["onnx"], threads=1).run(None, {"pixel_values": x})[0]
    with torch.no_grad():
        torch_logits = exported["model"](torch.from_numpy(x)).numpy()
    err = float(np.abs(got - want).max())
    print(f"{protocol}: {NAME}_py vs onnxruntime max|Δ| = {err:.2e}; vs PyTorch {np.abs(got - torch_logits).max():.2e}")
    assert got.shape == (5, 10) and err <= 1e-5


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_explain_model_rollout_equals_library(exported, clients, protocol):
    x = torch.randn(3, 3, RES, RES, generator=torch.Generator().manual_seed(2))
    result = _infer(clients[protocol], f"{NAME}_explain_py", {"pixel_values": x.numpy()})
    model = exported["model"]
    with torch.no_grad():
        _, attentions = model(x, return_attention=True)
    ref = rollout(attentions, (RES // 16, RES // 16), model.num_prefix_tokens, model.cfg.pool, "mean", 0.9).map
    want_logits = session(exported["explain"], threads=1).run(["logits"], {"pixel_values": x.numpy()})[0]
    ro_err = float(np.abs(result.as_numpy("rollout") - ref.numpy()).max())
    lo_err = float(np.abs(result.as_numpy("logits") - want_logits).max())
    print(f"{protocol}: rollout vs vit_serve.explain.rollout max|Δ| = {ro_err:.2e}; logits vs onnxruntime {lo_err:.2e}")
    assert result.as_numpy("rollout").shape == (3, RES // 16, RES // 16)
    assert ro_err <= 1e-5 and lo_err <= 1e-5


@pytest.fixture(scope="module")
def photos():
    data = pytest.importorskip("skimage.data")
    return [
        ("astronaut", _encode(data.astronaut(), "PNG")),
        ("coffee", _encode(data.coffee(), "JPEG")),
        ("chelsea", _encode(data.chelsea(), "JPEG")),
    ]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_on_encoded_images_and_top3_labels(exported, clients, photos, protocol):
    model = exported["model"]
    x = torch.stack([preprocess(b, model.preprocess_cfg) for _, b in photos])
    with torch.no_grad():
        want = model(x).numpy()
    images = np.array([[b] for _, b in photos], dtype=object)
    client = clients[protocol]
    pixels = _infer(client, f"{NAME}_preprocess", {"image": images}).as_numpy("pixel_values")
    assert np.array_equal(pixels, x.numpy())  # the one preprocessing function, bit for bit
    got = _infer(client, f"{NAME}_ensemble", {"image": images}).as_numpy("logits")
    err = float(np.abs(got - want).max())
    print(f"{protocol}: ensemble (PNG/JPEG bytes) vs PyTorch on vit_serve.preprocess max|Δ| = {err:.2e}")
    assert err <= 1e-4
    top = _infer(client, f"{NAME}_ensemble", {"image": images}, class_count=3).as_numpy("logits")
    assert top.shape == (3, 3)
    for row, ref in zip(top, want, strict=True):
        parsed = [entry.decode().split(":") for entry in row]  # "score:index:label"
        order = np.argsort(-ref)[:3]
        assert [int(i) for _, i, _ in parsed] == list(order)
        assert [label for _, _, label in parsed] == [LABELS[i] for i in order]
        assert np.allclose([float(s) for s, _, _ in parsed], ref[order], atol=1e-4)


def _concurrently(server, model: str, inputs: list[dict[str, np.ndarray]]) -> list:
    """Send every request at once (gRPC async); each answer is an InferResult or an InferenceServerException."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: list = [None] * len(inputs)
    done = threading.Semaphore(0)

    def callback(i: int, result, error) -> None:
        answers[i] = error if error is not None else result
        done.release()

    for i, named in enumerate(inputs):
        tensors = []
        for name, value in named.items():
            t = grpcclient.InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "FP32")
            t.set_data_from_numpy(value)
            tensors.append(t)
        client.async_infer(model, tensors, functools.partial(callback, i))
    for _ in inputs:
        assert done.acquire(timeout=60)
    client.close()
    return answers


def test_corrupt_image_fails_only_its_request(exported, server, photos):
    """Eight concurrent requests, one of them not an image: that one gets INVALID_ARG, the other seven logits."""
    model = exported["model"]
    payloads = [photos[i % 3][1] for i in range(8)]
    payloads[3] = b"\x89PNG\r\n\x1a\n but the rest is missing"
    before = _metrics(server, f"{NAME}_preprocess")
    answers = _concurrently(server, f"{NAME}_ensemble", [{"image": np.array([[p]], dtype=object)} for p in payloads])
    after = _metrics(server, f"{NAME}_preprocess")
    for i, (answer, p) in enumerate(zip(answers, payloads, strict=True)):
        if i == 3:
            assert isinstance(answer, InferenceServerException) and "cannot decode image" in answer.message()
            assert answer.status() == "StatusCode.INVALID_ARGUMENT"
            continue
        with torch.no_grad():
            want = model(preprocess(p, model.preprocess_cfg)[None]).numpy()
        assert np.abs(answer.as_numpy("logits") - want).max() <= 1e-4
    runs = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    print(f"{NAME}_preprocess: 8 requests in {runs:g} executions")
    assert runs < 8  # the bad image shared an execution with good ones, and only its request failed


def test_concurrent_requests_are_batched(exported, server):
    """32 concurrent requests of batch 1 to `_py`: fewer executions than inferences, and each answer its own."""
    x = torch.randn(32, 1, 3, RES, RES, generator=torch.Generator().manual_seed(3)).numpy()
    want = session(exported["onnx"], threads=1).run(None, {"pixel_values": x[:, 0]})[0]
    before = _metrics(server, f"{NAME}_py")
    answers = _concurrently(server, f"{NAME}_py", [{"pixel_values": xi} for xi in x])
    # Triton's /metrics can trail the answers by a moment: read it until the 32 inferences show (at most 10 s)
    deadline = time.monotonic() + 10
    while (after := _metrics(server, f"{NAME}_py"))["nv_inference_count"] - before["nv_inference_count"] < 32 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    got = np.concatenate([a.as_numpy("logits") for a in answers])
    count = after["nv_inference_count"] - before["nv_inference_count"]
    execs = after["nv_inference_exec_count"] - before["nv_inference_exec_count"]
    print(f"{NAME}_py: nv_inference_count +{count:g}, nv_inference_exec_count +{execs:g}")
    assert np.abs(got - want).max() <= 1e-5  # split back to the right requests
    assert count == 32 and execs < count


def test_gateway_reads_the_contract_from_the_server(exported, clients):
    cfg = clients["grpc"].get_model_config(f"{NAME}_ensemble", as_json=True)["config"]
    meta = json.loads(cfg["parameters"]["vit_serve"]["string_value"])
    assert meta["classifier"] == f"{NAME}_py" and meta["explain_model"] == f"{NAME}_explain_py"
    assert meta["preprocess"]["input_size"] == [RES, RES] and meta["labels"] == LABELS


def test_restart_keeps_the_ports(exported, server, clients):
    ports = (server.http_port, server.grpc_port, server.metrics_port)
    t0 = time.perf_counter()
    server.stop()
    assert not server.ready()
    server.start(timeout=120)
    print(f"tritonserver restarted in {time.perf_counter() - t0:.1f}s")
    assert (server.http_port, server.grpc_port, server.metrics_port) == ports
    x = np.zeros((1, 3, RES, RES), np.float32)
    want = session(exported["onnx"], threads=1).run(None, {"pixel_values": x})[0]
    got = _infer(httpclient.InferenceServerClient(server.http_address), f"{NAME}_py", {"pixel_values": x})
    assert np.abs(got.as_numpy("logits") - want).max() <= 1e-5


def test_a_model_that_fails_to_load_is_a_clear_error(tmp_path):
    reason = available()
    if reason:
        pytest.skip(reason)
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\nmax_batch_size: 1\n'
        'input { name: "x" data_type: TYPE_FP32 dims: 1 }\noutput { name: "y" data_type: TYPE_FP32 dims: 1 }\n'
    )
    (tmp_path / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('weights missing')\n"
    )
    srv = TritonServer(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="before it was ready") as info:
            srv.start(timeout=60)
        assert "weights missing" in str(info.value)
    finally:
        srv.close()
    with pytest.raises(FileNotFoundError):
        TritonServer(tmp_path / "nowhere")
