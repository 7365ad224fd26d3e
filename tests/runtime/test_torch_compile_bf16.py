"""`--compile` in bf16 (`LoadSpec.compile_precision`): CPU autocast through inductor, measured against eager fp32
on held-out digits scans by the bf16 bounds (`vit_serve.accuracy_bounds`: >= 99.5% top-1 agreement, cosine
>= 0.999) and refused with the numbers below them. Reference: the library's model in eager fp32. Needs a CPU with
bf16 (AVX512_BF16 or AMX)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.backends.torch import compile_forward, cpu_has_bf16, gate_inputs

pytest.importorskip("sklearn")
pytestmark = pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no bf16 (AVX512_BF16 or AMX)")

LABELS = [f"label_{i}" for i in range(10)]
RES = (32, 32)


def test_bf16_compile_passes_its_gate_and_answers_like_eager(tmp_path, save_tiny):
    ckpt = save_tiny(tmp_path / "tiny.safetensors", RES, 7, LABELS)
    backend = load(LoadSpec(str(ckpt), device="cpu", threads=1, compile=True, compile_precision="bf16"))
    model = vit_serve.load(ckpt).eval()
    x, _ = gate_inputs(RES, 16)
    with torch.inference_mode():
        want = model(x).numpy()
    got = backend.classify(x.numpy())
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.995 and cos.mean() >= 0.999
    assert np.abs(got - want).max() > 0  # bf16 ran: not eager fp32's own numbers


@pytest.fixture
def tied_model():
    """A model whose classes' logits differ by less than bf16 resolves: every head row one N(0, 1) row but for
    1e-4 (logits about -5.32, 1e-3 apart: bf16's step there is 3e-2)."""
    torch.manual_seed(0)
    model = vit_serve.create_model("Ti/16", num_classes=10, depth=2, img_size=RES).eval()
    with torch.no_grad():
        w = model.head.weight
        w.copy_(torch.randn(1, w.shape[1]).expand_as(w) + 1e-4 * torch.randn_like(w))
        model.head.bias.zero_()
    return model


def test_bf16_below_its_bounds_is_refused_with_the_numbers_and_auto_falls_back(tied_model):
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match=r"in bf16 is refused: bf16: top-1 agreement .*% \(>= 99\.5%\)"):
        compile_forward(tied_model, RES, torch.device("cpu"), "tied", "bf16")
    forward = compile_forward(tied_model, RES, torch.device("cpu"), "tied", "auto")
    x, _ = gate_inputs(RES, 8)
    with torch.inference_mode():
        got, want = forward(x)[0], tied_model(x)
    assert (got.argmax(1) == want.argmax(1)).all()  # fp32 again: the same ranking as eager
    forced = compile_forward(tied_model, RES, torch.device("cpu"), "tied", "bf16", force=True)
    assert forced is not None
