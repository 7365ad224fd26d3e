"""The OpenVINO backend on vit-export's graphs (random tiny ViTs, real photos): at f32 it answers as onnxruntime
(logits, embedding, the explain graph's rollout within 1e-4, dynamic resolution and batch); its native precision
passes the accuracy gate and stays within the bounds; a precision that misses them is refused with the numbers
unless forced; int8 needs an NNCF-quantized graph, measured against the fp32 export; the model cache serves a
restart; instances run at once; `.xml` and the `runtime` setting pick it; a process that released its models
still turns Ctrl-C into KeyboardInterrupt (vit_serve.signal_stack)."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.accuracy_bounds import BOUNDS, cosines
from vit_serve.manifest import EMBEDDING, LOGITS
from vit_serve.preprocess import preprocess
from vit_serve.runtime import LoadSpec, check, load, resolve_backend
from vit_serve.runtime.accuracy_gate import PrecisionRefusedError, gate_images
from vit_serve.runtime.discovery import scan
from vit_serve.runtime.model_config import ModelConfig

ov = pytest.importorskip("openvino")
skimage_data = pytest.importorskip("skimage.data")

RES = (32, 48)
LABELS = [f"class_{i}" for i in range(10)]


def _native_bf16() -> bool:
    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name() == "bf16"


def _export(folder: Path, save_tiny, fragile: bool = False, **options) -> Path:
    import vit_export

    ckpt = save_tiny(folder / "tiny.safetensors", RES, 5, LABELS)
    if fragile:
        # Pre-logits features 1000 away from zero, an offset the zero-mean head rows cancel in exact arithmetic:
        # fp32 keeps the features (resolution 6e-5 at 1000), bf16 rounds them to multiples of 4.
        model = vit_serve.load(ckpt)
        with torch.no_grad():
            model.norm.bias += 1000.0
            model.head.weight -= model.head.weight.mean(1, keepdim=True)
        vit_serve.save(model, ckpt, overwrite=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # the fragile model's logits cancel 1000s: onnxruntime's fp32 differs from PyTorch's by 1e-3 there
        tol = {"tol": 1e-2} if fragile else {}
        result = vit_export.export(ckpt, vit_export.ExportOptions(out=folder, name="tiny", **tol, **options))
    finally:
        torch.set_num_threads(threads)
    assert result.ok
    return result.onnx


@pytest.fixture(scope="module")
def exported(tmp_path_factory, save_tiny) -> Path:
    """tiny.onnx (logits + embedding) and its explain graph, 32x48, any resolution (multiples of 16) and batch."""
    return _export(tmp_path_factory.mktemp("ov"), save_tiny, outputs=(LOGITS, EMBEDDING), res="dynamic")


@pytest.fixture(scope="module")
def ort(exported):
    return load(LoadSpec(path=str(exported), backend="onnxruntime", device="cpu", threads=1))


@pytest.fixture(scope="module")
def f32(exported):
    return load(LoadSpec(path=str(exported), backend="openvino", precision="f32", threads=1, cache_dir=""))


@pytest.fixture(scope="module")
def pixels(ort) -> np.ndarray:
    """Real photos (scikit-image) in the export's contract, [4, 3, 32, 48]."""
    from PIL import Image

    arrays = [skimage_data.astronaut(), skimage_data.coffee(), skimage_data.chelsea(), skimage_data.rocket()]
    return torch.stack([preprocess(Image.fromarray(a), ort.info.preprocess) for a in arrays]).numpy()


def test_f32_answers_as_onnxruntime(f32, ort, pixels):
    info = f32.info
    assert (info.backend, info.precision, info.device, info.accuracy) == ("openvino", "fp32", "cpu", None)
    assert info.device_name == ov.Core().get_property("CPU", "FULL_DEVICE_NAME") and info.device_name
    for key in ("resolution", "patch_size", "num_classes", "labels", "preprocess", "rollout", "embedding_dim"):
        assert getattr(info, key) == getattr(ort.info, key), key
    np.testing.assert_allclose(f32.classify(pixels), ort.classify(pixels), atol=1e-4)
    (lo, eo), (lr, er) = f32.embed(pixels), ort.embed(pixels)
    np.testing.assert_allclose(lo, lr, atol=1e-4)
    np.testing.assert_allclose(eo, er, atol=1e-4)
    (logits, heat), (ref_logits, ref_heat) = f32.explain(pixels), ort.explain(pixels)
    assert heat.shape == ref_heat.shape == (4, 2, 3)
    np.testing.assert_allclose(heat, ref_heat, atol=1e-4)  # rollout through the explain graph (issue 43)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4)
    assert np.ptp(heat) > 1e-3  # a map, not a constant
    for i in range(len(pixels)):  # a row gives alone what it gives in the batch
        np.testing.assert_allclose(f32.classify(pixels[i:i + 1])[0], f32.classify(pixels)[i], atol=1e-5)


def test_dynamic_resolution_and_batch(f32, ort, pixels):
    ov_backend, ort_backend = f32, ort
    assert ov_backend.info.dynamic_resolution
    rng = np.random.default_rng(0)
    for h, w, b in ((32, 48, 1), (48, 64, 3), (64, 32, 2)):
        x = torch.nn.functional.interpolate(torch.from_numpy(pixels), size=(h, w), mode="bilinear").numpy()[:b]
        x = x + rng.normal(0, 0.01, x.shape).astype(np.float32)
        np.testing.assert_allclose(ov_backend.classify(x), ort_backend.classify(x), atol=1e-4)
        np.testing.assert_allclose(ov_backend.explain(x)[1], ort_backend.explain(x)[1], atol=1e-4)


def test_native_precision_passes_the_gate_within_its_bounds(exported, ort, pixels):
    native = load(LoadSpec(path=str(exported), backend="openvino", threads=1, cache_dir=""))
    if not _native_bf16():
        assert native.info.precision == "fp32" and native.info.accuracy is None  # auto on a CPU without bf16
        return
    gate = native.info.accuracy
    assert native.info.precision == "bf16" and gate is not None and gate.check.ok and not gate.forced
    assert gate.check.n == len(gate_images(native.info.preprocess)) >= 30
    min_agree, min_cos = BOUNDS["bf16"]
    assert gate.check.agreement >= min_agree and gate.check.cosine >= min_cos
    # the explain graph's maps in bf16 against f32's on the same photos, reported beside
    assert gate.rollout_max_abs is not None and 0 < gate.rollout_max_abs < 1
    logits, emb = native.embed(pixels)
    ref_logits, ref_emb = ort.embed(pixels)
    assert (logits.argmax(1) == ref_logits.argmax(1)).all()
    assert cosines(ref_emb, emb).min() >= min_cos and cosines(ref_logits, logits).min() >= min_cos
    assert np.abs(logits - ref_logits).max() > 0  # computed in bf16 indeed, not f32
    # the vectors moved with the arithmetic: another embedding space than the export's fp32 (vit_serve.fingerprint)
    assert native.info.embedding_space.precision == "bf16"
    assert native.info.embedding_fingerprint() != ort.info.embedding_fingerprint() is not None


def test_f32_keeps_the_exports_embedding_space(f32, ort):
    assert f32.info.embedding_fingerprint() == ort.info.embedding_fingerprint() is not None


def test_a_precision_missing_its_bounds_is_refused_with_the_numbers(tmp_path, save_tiny):
    if not _native_bf16():
        pytest.skip("this CPU computes bf16 as f32 (no AVX512-BF16 or AMX): nothing to refuse")
    onnx = _export(tmp_path, save_tiny, fragile=True)
    with pytest.raises(PrecisionRefusedError, match=r"bf16: top-1 agreement \d+\.\d% \(>= 99\.5%\), cosine "
                                                     r"[-\d.]+ \(>= 0\.999; smallest [-\d.]+\) on \d+ inputs: below"):
        load(LoadSpec(path=str(onnx), backend="openvino", precision="bf16", cache_dir=""))
    forced = load(LoadSpec(path=str(onnx), backend="openvino", precision="bf16", cache_dir="", force_precision=True))
    gate = forced.info.accuracy
    assert gate is not None and gate.forced and not gate.check.ok and gate.check.agreement < 0.995
    assert load(LoadSpec(path=str(onnx), backend="openvino", precision="f32", cache_dir="")).info.accuracy is None


def test_int8_needs_a_quantized_graph_and_is_measured_against_fp32(exported, tmp_path, ort):
    with pytest.raises(ValueError, match="int8 needs a quantized graph"):
        load(LoadSpec(path=str(exported), backend="openvino", precision="int8", cache_dir=""))
    nncf = pytest.importorskip("nncf")
    folder = tmp_path / "int8"
    folder.mkdir()
    for f in exported.parent.iterdir():  # the fp32 export, with the quantized IR written beside it
        (folder / f.name).write_bytes(f.read_bytes())
    x = gate_images(ort.info.preprocess)
    calibration = nncf.Dataset([x[i:i + 1] for i in range(0, len(x), 3)])
    quantized = nncf.quantize(ov.Core().read_model(str(exported)), calibration, model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(x) // 3)
    ov.save_model(quantized, str(folder / "tiny.xml"))
    backend = load(LoadSpec(path=str(folder / "tiny.onnx"), backend="openvino", cache_dir="", force_precision=True))
    gate = backend.info.accuracy
    assert backend.info.source.endswith("tiny.xml") and backend.info.precision == "int8"
    assert gate is not None and gate.check.precision == "int8" and gate.check.n == len(x)
    # the gate's numbers are the int8 graph's against the fp32 export, as onnxruntime computes it
    (logits, emb), (ref_logits, ref_emb) = backend.embed(x), ort.embed(x)
    assert gate.check.agreement == pytest.approx(float((logits.argmax(1) == ref_logits.argmax(1)).mean()))
    cosine = min(cosines(ref_logits, logits).mean(), cosines(ref_emb, emb).mean())
    assert gate.check.cosine == pytest.approx(float(cosine), abs=1e-5)
    assert gate.check.ok == (gate.check.agreement >= 0.98 and gate.check.cosine >= 0.99)
    assert gate.forced == (not gate.check.ok)
    assert gate.rollout_max_abs is not None  # against the fp32 export's explain graph beside it


def test_the_model_cache_serves_a_restart(exported, tmp_path, pixels, f32):
    cache = tmp_path / "cache"
    first = load(LoadSpec(path=str(exported), backend="openvino", precision="f32", cache_dir=str(cache)))
    blobs = sorted(p.name for p in cache.iterdir())
    assert blobs and all(b.endswith(".blob") for b in blobs)  # the logits and explain graphs, compiled
    again = load(LoadSpec(path=str(exported), backend="openvino", precision="f32", cache_dir=str(cache)))
    assert sorted(p.name for p in cache.iterdir()) == blobs  # read back, not compiled anew
    np.testing.assert_allclose(again.classify(pixels), first.classify(pixels), atol=1e-6)
    np.testing.assert_allclose(again.classify(pixels), f32.classify(pixels), atol=1e-5)


def test_ctrl_c_after_two_models_were_released_is_a_keyboard_interrupt(exported):
    """Two backends loaded and released first-made first (a reload), then SIGINT: Python's handler runs and raises
    KeyboardInterrupt. Without signal_stack.kept() around the plugin's compiles, the plugin left this thread on an
    unmapped alternate stack and the kernel killed the process with a SIGSEGV instead."""
    # raise_signal: delivered to this (the main) thread, whose alternate stack is the one at stake. A hang dumps
    # every thread's stack and exits.
    code = textwrap.dedent(f"""
        import faulthandler, gc, signal
        from vit_serve.runtime import LoadSpec, load
        faulthandler.enable()
        faulthandler.dump_traceback_later(120, exit=True)
        # Python's own SIGINT handler, whatever this process inherited (a shell's background job ignores SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        spec = LoadSpec(path={str(exported)!r}, backend="openvino", precision="f32", threads=1, cache_dir="")
        first = load(spec)
        second = load(spec)
        del first; gc.collect()
        del second; gc.collect()
        try:
            signal.raise_signal(signal.SIGINT)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != -signal.SIGSEGV, r.stderr[-3000:]
    assert (r.returncode, r.stdout.split()) == (0, ["interrupted"]), r.stderr[-3000:]


def test_every_compile_of_the_project_keeps_the_signal_stack():
    """The guard above lives in one place: each `compile_model` call of the project's sources is a call of
    `backends.openvino.compile_model`, and only that helper calls the plugin's own."""
    root = Path(__file__).resolve().parents[2]
    plugin_calls = []
    for folder in ("vit_serve", "export", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            helper = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "compile_model"),
                          None)
            inside = {id(n) for n in ast.walk(helper)} if helper else set()
            plugin_calls += [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(tree)
                             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                             and n.func.attr == "compile_model" and id(n) not in inside]
    assert plugin_calls == [], f"OpenVINO compiles outside backends.openvino.compile_model: {plugin_calls}"


def test_instances_run_at_once(f32, pixels):
    assert f32.concurrent and f32.staged(None, pixels) is None  # runs whole: no stages to pause between
    serial = [f32.classify(pixels[i:i + 2]) for i in (0, 2)]
    out: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        for _ in range(5):
            out[i] = f32.classify(pixels[i:i + 2])

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_allclose(out[0], serial[0], atol=1e-6)
    np.testing.assert_allclose(out[2], serial[1], atol=1e-6)


def test_the_suffix_and_the_runtime_setting_pick_openvino(exported, tmp_path):
    assert resolve_backend(LoadSpec(path="m.xml")) == "openvino"
    assert resolve_backend(LoadSpec(path="m.onnx")) == "onnxruntime"
    assert resolve_backend(LoadSpec(path="m.onnx", runtime="openvino")) == "openvino"
    spec = ModelConfig(runtime="openvino", precision="f32", streams=2, performance_hint="throughput").spec(
        LoadSpec(path=str(exported)))
    assert resolve_backend(spec) == "openvino" and (spec.precision, spec.streams) == ("f32", 2)
    assert resolve_backend(LoadSpec(path="m.safetensors", runtime="openvino")) == "torch"
    with pytest.raises(ValueError, match=r"--backend openvino serves an exported NAME\.onnx or an OpenVINO IR"):
        check(LoadSpec(path=str(exported.with_suffix(".json")), backend="openvino"))
    # an IR alone is a model of its own (its .bin no checkpoint); beside its NAME.onnx, a companion
    folder = tmp_path / "repo"
    folder.mkdir()
    ov.save_model(ov.Core().read_model(str(exported)), str(folder / "ir.xml"))
    (folder / "ir.json").write_bytes(exported.with_suffix(".json").read_bytes())
    entries = scan(folder)
    assert list(entries) == ["ir"] and entries["ir"].versions[1].backend == "openvino"
    served = load(LoadSpec(path=str(entries["ir"].versions[1].path), precision="f32", cache_dir=""))
    assert served.name == "openvino" and served.info.name == "ir"
    (folder / "ir.onnx").write_bytes(exported.read_bytes())
    entries = scan(folder)
    assert list(entries) == ["ir"] and entries["ir"].versions[1].backend == "onnxruntime"


def test_a_triton_config_of_the_openvino_backend_means_openvino(tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from vit_serve.runtime.discovery import read_triton_config

    config = tmp_path / "config.pbtxt"
    config.write_text('name: "m"\nbackend: "openvino"\nmax_batch_size: 8\n')
    assert read_triton_config(config).config.runtime == "openvino"
    config.write_text('name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n')
    assert read_triton_config(config).config.runtime is None
