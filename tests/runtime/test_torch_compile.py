"""`--compile` (`LoadSpec.compile`): the torch backend's classify / embed through `torch.compile` (inductor),
compiled and checked against eager at load. The reference is the library's own model in eager mode on the same
inputs, at batch 1 (its own graph) and at several larger batches (the one graph with a dynamic batch dimension:
no recompile, no wrong answer as the batcher's sizes vary)."""

from __future__ import annotations

import io
import threading

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
    return load(LoadSpec(str(ckpt), device="cpu", threads=1, compile=True))


def _batch(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, *RES)).astype(np.float32)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_logits_match_eager_at_every_batch_size_without_recompiling(compiled, reference):
    assert compiled.info.compiled and compiled.probe is None  # no eager-vs-onnxruntime probe when compiled
    graphs = _graphs()
    for n in (1, 3, 8, 2, 5, 1):
        x = _batch(n, seed=n)
        with torch.no_grad():
            want = reference(torch.from_numpy(x)).numpy()
        got = compiled.classify(x)
        assert got.shape == (n, len(LABELS))
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
        assert np.abs(want).max() > 0.1  # non-trivial logits: the comparison means something
    assert _graphs() == graphs  # the graphs compiled (and checked) at load serve every size


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


def test_compiled_embedding_matches_eager(compiled, reference):
    for n in (1, 4):
        x = _batch(n, seed=10 + n)
        with torch.no_grad():
            logits, embedding = reference.forward_embedding(torch.from_numpy(x))
        got_logits, got_embedding = compiled.embed(x)
        assert np.abs(got_logits - logits.numpy()).max() <= 1e-4 * max(1.0, float(logits.abs().max()))
        assert np.abs(got_embedding - embedding.numpy()).max() <= 1e-4 * max(1.0, float(embedding.abs().max()))


def test_explain_and_grad_rollout_stay_eager(compiled, reference):
    x = _batch(2, seed=3)
    logits, rollout = compiled.explain(x)
    with torch.no_grad():
        want = reference(torch.from_numpy(x)).numpy()
    assert np.abs(logits - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    assert rollout.shape == (2, 2, 2)
    assert compiled.grad_rollout(x[:1]).shape == (2, 2)


def test_another_checkpoint_of_the_same_shape_gets_its_own_answers(compiled, ckpt, tmp_path, save_tiny):
    """Dynamo shares graphs between models of one architecture (their weights are the graph's inputs): each
    backend must still answer with its own weights."""
    other_ckpt = save_tiny(tmp_path / "other.safetensors", RES, 8, LABELS)
    other = load(LoadSpec(str(other_ckpt), device="cpu", threads=1, compile=True))
    x = _batch(3, seed=4)
    with torch.no_grad():
        want = vit_serve.load(other_ckpt).eval()(torch.from_numpy(x)).numpy()
    got, first = other.classify(x), compiled.classify(x)
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


def test_the_setting_reaches_the_spec(ckpt):
    from vit_serve.serve.settings import ServeSettings

    assert LoadSpec.of(ServeSettings(model=str(ckpt), compile=True)).compile
    assert not LoadSpec.of(ServeSettings(model=str(ckpt))).compile


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_the_gateway_serves_the_compiled_model_with_the_same_answers(ckpt, compiled, ready_client):
    from vit_serve.serve.settings import ServeSettings

    answers = {}
    for flag in (False, True):
        settings = ServeSettings(model=str(ckpt), device="cpu", threads=1, decode="contract", compile=flag)
        with ready_client(settings) as client:
            answers[flag] = [client.post("/classify", files={"file": ("x.png", _png(s), "image/png")})
                             for s in range(3)]
    for eager, comp in zip(answers[False], answers[True], strict=True):
        assert eager.status_code == comp.status_code == 200, comp.text
        e, c = eager.json()["predictions"], comp.json()["predictions"]
        assert [p["label"] for p in c] == [p["label"] for p in e]
        assert np.allclose([p["score"] for p in c], [p["score"] for p in e], atol=1e-5)
