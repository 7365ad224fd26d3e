"""`vit-serve train` from the 2025-26 checkpoints: a DINOv3 (RoPE only) and a SigLIP 2 tower, built by timm with
random weights at tiny widths, converted with our converter and fine-tuned on the digits set through the library's
train entry point; layer-wise lr decay of RoPE models (against timm's own groups, and RoPE-ViT mixed's learned
frequencies with their blocks); the resolution change of a RoPE-only model; few-shot linear evaluation."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

import vit_serve
from vit_serve.checkpoints import build_model, read_checkpoint
from vit_serve.data import digits_tensors
from vit_serve.model import VisionTransformer
from vit_serve.train.config import OptionError, TrainConfig
from vit_serve.train.fewshot import few_shot_eval, few_shot_eval_features
from vit_serve.train.loop import Trainer, train
from vit_serve.train.loop import build_model as build_train_model
from vit_serve.train.progress import read_metrics
from vit_serve.train.recipes import layer_decay_groups

timm = pytest.importorskip("timm")
from timm.models._hub import save_for_hf  # noqa: E402

DIGITS = [str(i) for i in range(10)]
# timm name -> tiny create_model overrides (head width 16, two blocks).
SOURCES = {
    "vit_small_patch16_dinov3": dict(embed_dim=96, img_size=32, global_pool="token", num_classes=0),
    "vit_base_patch16_siglip_224.v2_webli": dict(embed_dim=96, num_heads=6, img_size=32, num_classes=0),
    "vit_pe_core_tiny_patch16_384": dict(embed_dim=48, img_size=32, num_classes=0),
    "vit_small_patch16_rope_mixed_224": dict(embed_dim=96, img_size=32, num_classes=10),
}
_HUB_ARGS = ("num_heads", "img_size", "global_pool")


@torch.no_grad()
def _timm(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    ref = timm.create_model(name, pretrained=False, depth=2, dynamic_img_size=True, **{**SOURCES[name], **overrides})
    g = torch.Generator().manual_seed(seed)
    for p in ref.state_dict().values():  # LayerScale 1e-5 and zero biases: nothing may stay trivial
        if p.is_floating_point():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return ref.eval()


def _converted(name: str, folder, **overrides) -> tuple[torch.nn.Module, VisionTransformer]:
    """timm's model and ours, read from the hub folder timm's save_for_hf writes (as `vit-serve convert` reads)."""
    ref = _timm(name, **overrides)
    save_for_hf(ref, folder, safe_serialization=True,
                model_args={k: v for k, v in SOURCES[name].items() if k in _HUB_ARGS})
    return ref, build_model(read_checkpoint(folder)).eval()


def _per_param(model: torch.nn.Module, groups: list[dict]) -> dict[str, tuple[float, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3", "vit_pe_core_tiny_patch16_384",
                                  "vit_small_patch16_rope_mixed_224"])
def test_layer_decay_of_rope_models_is_timms(name, tmp_path):
    """The number of weights at each (lr scale, weight decay) equals timm's create_optimizer_v2(layer_decay=R) on
    timm's own model (our names differ where the import splits fused tensors), but for one documented choice:
    the final norm after the encoder (1.0; timm: with the last block). RoPE-ViT mixed's frequencies are at the
    head's lr without weight decay, as timm's. A model without pos_embed groups without it. With a head, so that
    timm counts a layer after the encoder as we do."""
    from timm.optim import create_optimizer_v2

    ref, model = _converted(name, tmp_path / "hub", num_classes=10)
    r, wd = 0.5, 0.05
    want = create_optimizer_v2(ref, "adamw", lr=1e-3, weight_decay=wd, layer_decay=r).param_groups
    groups = layer_decay_groups(model, wd, r, depth=2)
    timm_names = {id(p): n for n, p in ref.named_parameters()}

    def count(groups, names, skip) -> Counter:
        c: Counter = Counter()
        for g in groups:
            for p in g["params"]:
                if not skip(names[id(p)]):
                    c[(g["lr_scale"], g["weight_decay"])] += p.numel()
        return c

    ours_names = {id(p): n for n, p in model.named_parameters()}
    special = ("norm.weight", "norm.bias")
    assert count(groups, ours_names, special.__contains__) == count(want, timm_names, special.__contains__)
    got = _per_param(model, groups)
    assert got["norm.weight"] == (1.0, 0.0) and got["patch_embed.proj.weight"] == (r**3, wd)
    assert ("pos_embed" in got) == (model.pos_embed is not None)
    if name.endswith("rope_mixed_224"):
        assert got["rope.freqs"] == (1.0, 0.0)
        assert got["blocks.0.attn.proj.weight"] == (r**2, wd) and got["blocks.1.attn.proj.weight"] == (r, wd)


def test_resolution_change_of_a_rope_only_model(tmp_path):
    """DINOv3 has no absolute position embedding: fine-tuning at another resolution changes the config and the
    preprocessing only; the weights are the checkpoint's and the model is timm's at that size."""
    ref, model = _converted("vit_small_patch16_dinov3", tmp_path / "hub")
    init = vit_serve.save(model, tmp_path / "dinov3.safetensors")
    cfg = TrainConfig(mode="finetune", init=str(init), res=(48, 32), new_head=False, out=str(tmp_path / "run"))
    moved = build_train_model(cfg, [])
    assert model.pos_embed is None and moved.cfg.img_size == (48, 32)
    assert tuple(moved.preprocess_cfg.input_size) == (48, 32)
    a, b = model.state_dict(), moved.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 3, 48, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.forward_features(x)[:, 0]  # timm's class token after the final norm
        got = moved.eval().forward_embedding(x)[1]
    assert (got - want).abs().max() <= 1e-4
    with pytest.raises(OptionError, match="no absolute position embeddings to reinitialise"):
        build_train_model(TrainConfig(mode="finetune", init=str(init), reinit_pos_embed=True), [])


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3", "vit_base_patch16_siglip_224.v2_webli"])
def test_digits_finetune_from_a_converted_checkpoint(name, tmp_path, one_thread):
    """A short digits fine-tune with layer decay: the loss goes down, and model.safetensors loads back to the
    trained model's logits; its few-shot accuracies come with the summary."""
    _, model = _converted(name, tmp_path / "hub")
    init = vit_serve.save(model, tmp_path / "init.safetensors")
    out = tmp_path / "run"
    cfg = TrainConfig(mode="finetune", init=str(init), out=str(out), steps=30, batch_size=32, lr=0.003,
                      optimizer="adam", warmup_steps=3, layer_decay=0.75, translate=0.0, dropout=0.0, log_every=1,
                      eval_every=0, few_shot=(2,), progress=False, reference=False)
    t = Trainer(cfg)
    summary = t.run()
    log = _losses(out)
    first, last = sum(log[s] for s in range(1, 6)) / 5, sum(log[s] for s in range(26, 31)) / 5
    print(f"{name}: loss {first:.3f} -> {last:.3f}, top-1 {summary['top1']:.3f}, few-shot {summary['few_shot']}")
    assert last < 0.8 * first
    saved = vit_serve.load(out / "model.safetensors")
    assert saved.cfg.rope == model.cfg.rope and saved.labels == DIGITS
    x, _ = digits_tensors("test", saved.preprocess_cfg)
    with torch.no_grad():
        err = (saved.eval()(x[:64]) - t.model.eval()(x[:64])).abs().max().item()
    assert err <= 1e-5, err
    assert set(summary["few_shot"]) == {2} and 0.0 <= summary["few_shot"][2] <= 1.0


def test_few_shot_of_a_rope_model_is_that_of_timms_features(tmp_path):
    """Few-shot linear evaluation of the converted DINOv3 = the same solver on timm's own class-token features."""
    ref, model = _converted("vit_small_patch16_dinov3", tmp_path / "hub")
    model.preprocess_cfg = model.preprocess_cfg.with_size(32, 32)
    (xtr, ytr), (xte, yte) = (digits_tensors(s, model.preprocess_cfg) for s in ("train", "test"))
    got = few_shot_eval(model, xtr, ytr, xte, yte, shots=(1, 5))
    with torch.no_grad():
        ftr, fte = (ref.forward_features(x)[:, 0] for x in (xtr, xte))
    want = few_shot_eval_features(ftr, ytr, fte, yte, shots=(1, 5))
    print("few-shot, ours:", got, "timm's features:", want)
    assert got == want and got[5] > 0.15


def test_rope_mixed_finetune_resumes_exactly(tmp_path, one_thread):
    """RoPE-ViT mixed with layer decay (its frequencies scaled row by row after each step): 6 steps straight =
    4 steps, stop, resume, 2 more, bit for bit; the frequencies did move."""
    _, model = _converted("vit_small_patch16_rope_mixed_224", tmp_path / "hub")
    init = vit_serve.save(model, tmp_path / "mixed.safetensors")
    kw = dict(mode="finetune", init=str(init), steps=6, batch_size=16, lr=0.01, optimizer="adam", warmup_steps=1,
              layer_decay=0.5, log_every=1, eval_every=0, progress=False, reference=False)
    train(TrainConfig(out=str(tmp_path / "straight"), **kw))
    t = Trainer(TrainConfig(out=str(tmp_path / "split"), **kw))
    t.t_start = t.t_log = time.perf_counter()  # what run() sets before its loop
    while t.state.step < 4:
        t.log(t.step())
    t.checkpoint()
    t.log_file.close()
    train(TrainConfig(out=str(tmp_path / "split"), resume=True, **kw))
    a, b = (vit_serve.load(tmp_path / run / "model.safetensors").state_dict() for run in ("straight", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "split")
    assert (a["rope.freqs"] - model.rope.freqs.detach()).abs().max() > 1e-4
