"""`--compile` (`LoadSpec.compile`) and `--torchscript` (`LoadSpec.torchscript`): the torch backend's classify /
embed through `torch.compile` (inductor) or a TorchScript trace, made and checked against eager at load. The
reference is the library's own model in eager mode on the same inputs, at batch 1 and at several larger batches
(inductor's one graph with a dynamic batch dimension: no recompile, no wrong answer as the batcher's sizes vary;
the trace's symbolic batch). The trace's reason to be, a forward that runs while another thread holds Python's
GIL, is checked against eager's, which cannot."""

from __future__ import annotations

import ctypes
import io
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

import vit_serve
from vit_serve.runtime import LoadSpec, check, load
from vit_serve.runtime.backends.torch import mismatch

LABELS = [f"label_{i}" for i in range(10)]
RES = (32, 32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("compile") / "tiny.safetensors", RES, 7, LABELS)


@pytest.fixture(scope="module")
def reference(ckpt):
    return vit_serve.load(ckpt).eval()


@pytest.fixture(scope="module")
def compiled(ckpt):
    return load(LoadSpec(str(ckpt), device="cpu", threads=1, compile=True, choose_runtime=True))


@pytest.fixture(scope="module")
def traced(ckpt):
    return load(LoadSpec(str(ckpt), device="cpu", threads=1, torchscript=True, choose_runtime=True))


@pytest.fixture(params=["compiled", "traced"])
def fast(request):
    """The compiled backend, then the traced one."""
    return request.getfixturevalue(request.param)


def _batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, *RES)).astype(np.float32)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _check_every_batch_size(backend, reference, rtol: float) -> None:
    """`backend.classify` against the reference in eager mode at batches of 1 to 8, in an order that goes back
    and forth."""
    for n in (1, 3, 8, 2, 5, 1):
        x = _batch(n, seed=n)
        with torch.no_grad():
            want = reference(torch.from_numpy(x)).numpy()
        got = backend.classify(x)
        assert got.shape == (n, len(LABELS))
        assert np.abs(got - want).max() <= rtol * max(1.0, np.abs(want).max())
        assert np.abs(want).max() > 0.1  # non-trivial logits: the comparison means something


def test_compiled_logits_match_eager_at_every_batch_size_without_recompiling(compiled, reference):
    assert compiled.info.compiled and compiled.info.runtime_choice is None  # asked, but no runtime choice compiled
    graphs = _graphs()
    _check_every_batch_size(compiled, reference, 1e-4)
    assert _graphs() == graphs  # the graphs compiled (and checked) at load serve every size


def test_traced_logits_match_eager_at_every_batch_size(traced, reference):
    assert traced.info.torchscript and not traced.info.compiled and traced.info.runtime_choice is None
    _check_every_batch_size(traced, reference, 1e-5)  # eager's own kernels


def _cpu_while_the_gil_is_held(backend, x: np.ndarray, hold_s: float) -> tuple[float, float]:
    """(CPU seconds this process gets while its main thread holds the GIL for `hold_s` and a worker thread runs
    `backend.classify(x)`, those the forward had spent before): libc's usleep called through ctypes.PyDLL keeps
    the GIL and takes no CPU, so what the process computes meanwhile (the worker and torch's intra-op threads)
    needs no GIL. The hold starts once the forward is well under way."""
    started = threading.Event()

    def run() -> None:
        started.set()
        backend.classify(x)

    worker = threading.Thread(target=run)
    start = time.process_time()
    worker.start()
    started.wait()
    for _ in range(3000):  # until the forward is well under way (these waits release the GIL)
        threading.Event().wait(0.01)
        if (before := time.process_time()) >= start + 0.15 or not worker.is_alive():
            break
    ctypes.PyDLL(None).usleep(int(hold_s * 1e6))
    held = time.process_time() - before
    worker.join()
    return held, before - start


def test_the_traced_forward_runs_while_another_thread_holds_the_gil(tmp_path):
    """Why --torchscript exists: eager PyTorch takes the GIL back between operators, so a model thread stalls
    while the event loop holds it; the trace runs its whole forward in TorchScript's interpreter without it."""
    model = vit_serve.create_model("Ti/16", num_classes=10, img_size=64)
    vit_serve.save(model, tmp_path / "ti.safetensors")
    x = _batch(512, seed=1).repeat(2, axis=2).repeat(2, axis=3)  # [512, 3, 64, 64]: about a second's forward
    cpu = {}
    for torchscript in (False, True):
        backend = load(LoadSpec(str(tmp_path / "ti.safetensors"), device="cpu", threads=1, torchscript=torchscript))
        backend.classify(x)  # warm
        t0 = time.process_time()
        backend.classify(x)
        one = time.process_time() - t0  # one forward's CPU
        held, before = _cpu_while_the_gil_is_held(backend, x, hold_s=3.0)
        cpu[torchscript] = (held, one - before)
    print(f"\nCPU the process got while its main thread held the GIL for 3 s (what the forward had left): eager "
          f"{cpu[False][0]:.2f} s ({cpu[False][1]:.2f} s), traced {cpu[True][0]:.2f} s ({cpu[True][1]:.2f} s)")
    assert min(cpu[False][1], cpu[True][1]) > 0.3  # the hold started with most of each forward left
    assert cpu[False][0] < 0.25 * cpu[False][1]  # eager: one operator at most
    assert cpu[True][0] > 0.5 * cpu[True][1]  # traced: most of what was left


def _compiled_regions(fn, x: np.ndarray) -> list[str]:
    """The compiled regions a call of `fn(x)` ran (the profiler's record of dynamo's graphs), in a new thread (the
    gateway calls from its model thread)."""
    from torch.profiler import profile

    found: list[str] = []

    def call() -> None:
        with profile() as prof:
            fn(x)
        found.extend(sorted({e.name for e in prof.events() if e.name.startswith("Torch-Compiled Region")}))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    return found


def test_classify_and_embed_run_the_compiled_graphs(compiled, ckpt):
    assert _compiled_regions(compiled.classify, _batch(1)) and _compiled_regions(compiled.classify, _batch(6))
    assert _compiled_regions(compiled.embed, _batch(3))
    assert not _compiled_regions(compiled.explain, _batch(2))  # eager: it needs the attentions
    eager = load(LoadSpec(str(ckpt), device="cpu", threads=1))
    assert not eager.info.compiled and not _compiled_regions(eager.classify, _batch(2))


def test_compiled_and_traced_embeddings_match_eager(fast, reference):
    for n in (1, 4):
        x = _batch(n, seed=10 + n)
        with torch.no_grad():
            logits, embedding = reference.forward_embedding(torch.from_numpy(x))
        got_logits, got_embedding = fast.embed(x)
        assert np.abs(got_logits - logits.numpy()).max() <= 1e-4 * max(1.0, float(logits.abs().max()))
        assert np.abs(got_embedding - embedding.numpy()).max() <= 1e-4 * max(1.0, float(embedding.abs().max()))


def test_explain_and_grad_rollout_stay_eager(fast, reference):
    x = _batch(2, seed=3)
    logits, rollout = fast.explain(x)
    with torch.no_grad():
        want = reference(torch.from_numpy(x)).numpy()
    assert np.abs(logits - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert rollout.shape == (2, 2, 2)
    assert fast.grad_rollout(x[:1]).shape == (2, 2)


@pytest.mark.parametrize("option", ["compile", "torchscript"])
def test_another_checkpoint_of_the_same_shape_gets_its_own_answers(option, ckpt, tmp_path, save_tiny, request):
    """Dynamo shares graphs between models of one architecture (their weights are the graph's inputs), and a
    trace keeps its module's weights: each backend must still answer with its own weights."""
    first_backend = request.getfixturevalue("compiled" if option == "compile" else "traced")
    other_ckpt = save_tiny(tmp_path / "other.safetensors", RES, 8, LABELS)
    other = load(LoadSpec(str(other_ckpt), device="cpu", threads=1, **{option: True}))
    x = _batch(3, seed=4)
    with torch.no_grad():
        want = vit_serve.load(other_ckpt).eval()(torch.from_numpy(x)).numpy()
    got, first = other.classify(x), first_backend.classify(x)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert np.abs(got - first).max() > 0.1


def test_the_parity_check_flags_a_difference():
    want = torch.tensor([[1.0, -4.0, 2.0]])
    assert mismatch(want + 1e-6, want, 1e-3) is None
    diff, tol = mismatch(want + torch.tensor([[0.0, 0.01, 0.0]]), want, 1e-3)
    assert diff == pytest.approx(0.01) and tol == pytest.approx(4e-3 + 1e-5)
    assert mismatch(torch.full_like(want, float("nan")), want, 1e-3) is not None


def test_compile_is_refused_for_exports(tmp_path):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^--compile runs checkpoints through torch\.compile \(the torch backend\), "
                                         r"not m\.onnx \(onnxruntime\): serve it without --compile$"):
        check(LoadSpec(str(onnx), compile=True))
    engine = tmp_path / "m.plan"
    engine.write_bytes(b"")
    with pytest.raises(ValueError, match=r"not m\.plan \(torch\)"):
        check(LoadSpec(str(engine), backend="torch", compile=True))
    with pytest.raises(ValueError, match=r"not vit \(triton\)"):
        check(LoadSpec("vit", backend="triton", compile=True))
    with pytest.raises(ValueError, match=r"not the Triton server.s models \(triton\)"):
        check(LoadSpec("", backend="triton", compile=True))
    assert check(LoadSpec(str(onnx))) == "onnxruntime"


def test_torchscript_is_refused_for_exports_and_beside_compile(tmp_path, ckpt):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"")
    with pytest.raises(ValueError, match=r"^--torchscript traces checkpoints \(the torch backend\), not m\.onnx "
                                         r"\(onnxruntime\): serve it without --torchscript$"):
        check(LoadSpec(str(onnx), torchscript=True))
    with pytest.raises(ValueError, match=r"not the Triton server.s models \(triton\)"):
        check(LoadSpec("", backend="triton", torchscript=True))
    with pytest.raises(ValueError, match=r"^--compile and --torchscript both replace the eager forward: choose one$"):
        check(LoadSpec(str(ckpt), compile=True, torchscript=True))


def test_the_setting_reaches_the_spec(ckpt):
    from vit_serve.serve.settings import ServeSettings

    assert LoadSpec.of(ServeSettings(model=str(ckpt), compile=True)).compile
    assert not LoadSpec.of(ServeSettings(model=str(ckpt))).compile
    assert LoadSpec.of(ServeSettings(model=str(ckpt), torchscript=True)).torchscript
    assert not LoadSpec.of(ServeSettings(model=str(ckpt))).torchscript


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("option", ["compile", "torchscript"])
def test_the_gateway_serves_the_compiled_or_traced_model_with_the_same_answers(option, ckpt, ready_client, request):
    from vit_serve.serve.settings import ServeSettings

    if option == "compile":
        request.getfixturevalue("compiled")  # inductor's cache warm: the gateway's own compile is quick
    answers, shown = {}, {}
    for flag in (False, True):
        settings = ServeSettings(model=str(ckpt), device="cpu", threads=1, decode="contract", **{option: flag})
        with ready_client(settings) as client:
            answers[flag] = [client.post("/classify", files={"file": ("x.png", _png(s), "image/png")})
                             for s in range(3)]
            version = client.get("/models").json()["models"][0]["versions"][0]
            shown[flag] = (version["compiled"], version["torchscript"])
    assert shown == {False: (False, False), True: (option == "compile", option == "torchscript")}
    for eager, comp in zip(answers[False], answers[True], strict=True):
        assert eager.status_code == comp.status_code == 200, comp.text
        e, c = eager.json()["predictions"], comp.json()["predictions"]
        assert [p["label"] for p in c] == [p["label"] for p in e]
        assert np.allclose([p["score"] for p in c], [p["score"] for p in e], atol=1e-5)
