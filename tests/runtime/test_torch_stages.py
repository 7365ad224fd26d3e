"""The torch backend's staged runs (`TorchBackend.staged`, `Stages`): classify and embed one step a stage (the stem,
each encoder block, the tail), eager or traced, which the batching runner may pause between blocks for more urgent
work. Reference: timm. A timm ViT with random weights is converted to a vit-serve checkpoint; a staged run's logits
equal timm's `forward(x)` and its embedding timm's `forward_head(forward_features(x), pre_logits=True)`, with each
step in a thread of its own (as the runner's model threads take them) and with a whole run of another batch
between two steps (what a pause lets happen)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.runtime import LoadSpec, load
from vit_serve.runtime.task import CLASSIFY, EMBED, Task

timm = pytest.importorskip("timm")

RES = (48, 48)  # square: the timm converter infers the grid from the position embeddings
DEPTH = 3
LABELS = [f"label_{i}" for i in range(10)]
TOL = 1e-5


@pytest.fixture(scope="module")
def timm_model(randomize):
    """timm's ViT-Ti/16, 3 blocks at 48x48, random non-trivial weights: the reference."""
    return randomize(timm.create_model("vit_tiny_patch16_224", num_classes=len(LABELS), depth=DEPTH, img_size=RES),
                     seed=11).eval()


@pytest.fixture(scope="module")
def ckpt(timm_model, tmp_path_factory):
    from vit_serve.checkpoints import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    model = build_model(convert_timm(timm_model.state_dict(), "vit_tiny_patch16_224"))
    model.labels = list(LABELS)
    path = tmp_path_factory.mktemp("stages") / "timm_tiny.safetensors"
    vit_serve.save(model, path)
    return path


@pytest.fixture(scope="module", params=["eager", "traced"])
def backend(request, ckpt):
    return load(LoadSpec(str(ckpt), device="cpu", threads=1, torchscript=request.param == "traced"))


def _x(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, *RES)).astype(np.float32)


def _timm(timm_model, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        t = torch.from_numpy(x)
        return (timm_model(t).numpy(),
                timm_model.forward_head(timm_model.forward_features(t), pre_logits=True).numpy())


def _in_threads(stages) -> tuple[dict, int]:
    """Each step of `stages` in a new thread: (the outputs, the steps taken)."""
    out: dict = {}
    steps = 0

    def step() -> None:
        try:
            next(stages)
        except StopIteration as done:
            out.update(done.value)

    while not out:
        t = threading.Thread(target=step)
        t.start()
        t.join()
        steps += 1
    return out, steps


@pytest.mark.parametrize("task", [CLASSIFY, EMBED], ids=["classify", "embed"])
def test_a_staged_run_equals_timm_step_by_step_in_other_threads(backend, timm_model, task):
    for n in (1, 3):
        x = _x(n, seed=n)
        logits, embedding = _timm(timm_model, x)
        out, steps = _in_threads(backend.staged(task, x))
        assert steps == DEPTH + 2  # the stem, each block, the tail
        assert np.abs(out["logits"] - logits).max() <= TOL * max(1.0, np.abs(logits).max())
        assert np.abs(logits).max() > 0.1  # non-trivial logits: the comparison means something
        if task == EMBED:
            assert np.abs(out["embedding"] - embedding).max() <= TOL * max(1.0, np.abs(embedding).max())
        else:
            assert "embedding" not in out


def test_a_run_paused_between_blocks_is_unchanged_by_another_batch_meanwhile(backend, timm_model):
    x, other = _x(2, seed=5), _x(4, seed=6)
    paused = backend.staged(CLASSIFY, x)
    for _ in range(2):  # the stem and the first block
        next(paused)
    meanwhile = backend.run(CLASSIFY, other)["logits"]  # the more urgent batch, run whole
    rest = backend.staged(EMBED, other)  # and one more staged run started and finished in between
    out, _ = _in_threads(rest)
    out_paused, _ = _in_threads(paused)
    for got, xs in ((meanwhile, other), (out["logits"], other), (out_paused["logits"], x)):
        want = _timm(timm_model, xs)[0]
        assert np.abs(got - want).max() <= TOL * max(1.0, np.abs(want).max())


def test_explain_and_grad_rollout_and_token_merging_run_whole(backend, ckpt):
    x = _x(1, seed=0)
    assert backend.staged(Task(kind="explain"), x) is None
    assert backend.staged(Task(kind="grad_rollout"), x) is None
    merged = load(LoadSpec(str(ckpt), device="cpu", threads=1, tome=1))
    assert merged.staged(CLASSIFY, x) is None  # merging's state is one forward's: no stages


def test_exports_run_whole(export_tiny, tmp_path):
    pytest.importorskip("onnxruntime")
    result, _ = export_tiny(tmp_path, 32, 3, LABELS, out=tmp_path / "exports")
    onnx = load(LoadSpec(str(result.onnx), device="cpu", threads=1))
    assert onnx.staged(CLASSIFY, _x(1, 0)[:, :, :32, :32]) is None  # the LocalBackend default: one call


def test_rope_models_run_whole(tmp_path):
    """A RoPE model's blocks need the rotary table of the input's patch grid: no stages, the whole forward."""
    from vit_serve.config import RopeConfig, ViTConfig
    from vit_serve.model import VisionTransformer

    model = VisionTransformer(ViTConfig(img_size=RES, embed_dim=64, num_heads=4, depth=2, mlp_dim=128, num_classes=3,
                                        pos_embed=False, rope=RopeConfig("dinov3", 100.0, rotate_half=True))).eval()
    vit_serve.save(model, tmp_path / "rope.safetensors")
    backend = load(LoadSpec(str(tmp_path / "rope.safetensors"), device="cpu", threads=1))
    x = _x(2, seed=3)
    assert backend.staged(CLASSIFY, x) is None
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    assert np.abs(backend.run(CLASSIFY, x)["logits"] - want).max() <= TOL
