"""The load-time runtime choice with two real runtimes (`vit_serve.runtime.torch_forwards`): a small random-weight
checkpoint on PyTorch eager and on its in-memory export in onnxruntime (and OpenVINO where installed), no mocks.
Which one wins is whatever this CPU says: the assertions are that the one served is the fastest of those that pass
in the table measured, that its answers are eager's, and that a pin serves its runtime unmeasured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.runtime_choice import accuracy, refusal
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.torch_forwards import EAGER, choose_forward

LABELS = [f"label_{i}" for i in range(10)]
RES = (32, 32)
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, save_tiny):
    return save_tiny(tmp_path_factory.mktemp("choice") / "tiny.safetensors", RES, 2, LABELS)


@pytest.fixture(scope="module")
def batch() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((5, 3, *RES)).astype(np.float32)


def _eager(ckpt, batch) -> tuple[np.ndarray, np.ndarray]:
    model = vit_serve.load(ckpt).eval()
    with torch.inference_mode():
        logits, embedding = model.forward_embedding(torch.from_numpy(batch))
    return logits.numpy(), embedding.numpy()


def test_the_fastest_runtime_that_passes_serves(ckpt, batch):
    spec = LoadSpec(str(ckpt), device="cpu", choose_runtime=True, choice_budget_s=2.0,
                    limits=RunnerLimits(max_batch=4))
    backend = load(spec)
    table = backend.info.runtime_choice
    assert table is not None and not table.pinned
    keys = [r.key for r in table.rows]
    assert keys[:2] == ["eager:fp32", "onnxruntime:fp32"]
    assert keys[2:] in ([], ["openvino:bf16"], ["openvino:fp32"])  # OpenVINO in its native precision, if installed
    for row in table.rows:  # every one measured at batch 1 and the batch limit, judged by its precision's bounds
        assert set(row.images_per_s) == {1, 4} and all(v > 0 for v in row.images_per_s.values())
        assert (row.refused is None) is (refusal(row.precision, row.agreement, row.cosine) is None)
    assert all(r.refused is None and r.agreement == 1.0 and r.cosine > 0.9999 for r in table.rows[:2])
    fastest = max((r for r in table.rows if r.refused is None), key=lambda r: r.score)
    assert table.chosen == fastest.key
    # the runtime chosen is the one that runs: an exported single graph has no stages, eager keeps them
    assert (backend._stages is None) is (fastest.runtime != EAGER)
    logits, embedding = _eager(ckpt, batch)
    got_logits, got_embedding = backend.embed(batch)
    if fastest.precision == "fp32":
        assert np.abs(backend.classify(batch) - logits).max() <= 1e-4
        assert np.abs(got_logits - logits).max() <= 1e-4 and np.abs(got_embedding - embedding).max() <= 1e-4
    else:
        assert refusal(fastest.precision, *accuracy(logits, got_logits)) is None


@pytest.mark.parametrize("pin", ["onnxruntime", "onnxruntime:fp32", EAGER])
def test_a_pin_serves_its_runtime_unmeasured(ckpt, batch, pin):
    backend = load(LoadSpec(str(ckpt), device="cpu", pin_runtime=pin))
    table = backend.info.runtime_choice
    assert table.pinned and table.chosen.split(":")[0] == pin.split(":")[0]
    assert all(not r.images_per_s for r in table.rows)
    assert (backend._stages is None) is (pin != EAGER)
    assert np.abs(backend.classify(batch) - _eager(ckpt, batch)[0]).max() <= 1e-4


def test_a_pin_that_names_no_runtime_of_a_checkpoint_fails_the_load(ckpt):
    with pytest.raises(ValueError, match="pin_runtime 'tensorrt': a checkpoint on the CPU runs on eager, onnxruntime"):
        load(LoadSpec(str(ckpt), device="cpu", pin_runtime="tensorrt"))
    with pytest.raises(ValueError, match="'onnxruntime:int8' names none of this model's runtimes"):
        load(LoadSpec(str(ckpt), device="cpu", pin_runtime="onnxruntime:int8"))


def test_no_choice_without_the_setting(ckpt):
    assert load(LoadSpec(str(ckpt), device="cpu")).info.runtime_choice is None


def test_a_dynamic_batch_export_answers_every_batch_size(ckpt):
    model = vit_serve.load(ckpt).eval()
    forward, _ = choose_forward(model, RES, pin="onnxruntime")
    for b in (1, 3, 7):
        x = torch.randn(b, 3, *RES, generator=torch.Generator().manual_seed(b))
        with torch.inference_mode():
            want = model(x).numpy()
        assert np.abs(forward(x)[0].numpy() - want).max() <= 1e-4
