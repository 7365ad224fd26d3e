"""Fine-tuning the families as their users do: layer-wise lr decay (against timm's `create_optimizer_v2`), an EMA of
the weights (against timm's `ModelEmaV3`), DeiT distillation (against facebookresearch/deit `DistillationLoss`,
re-implemented here), and exact resume with all three on. Tiny models on the embedded digits set."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vit_serve
from vit_serve.config import ViTConfig
from vit_serve.model import VisionTransformer
from vit_serve.train.config import OptionError, TrainConfig
from vit_serve.train.distill import load_teacher
from vit_serve.train.ema import ModelEMA
from vit_serve.train.loop import Trainer, train
from vit_serve.train.progress import read_metrics
from vit_serve.train.recipes import build_optimizer, build_schedule, layer_decay_groups, lr_factor

timm = pytest.importorskip("timm")

DIGITS = [str(i) for i in range(10)]
TINY = dict(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10)

# timm architecture -> (its tiny kwargs, our ViTConfig fields for the same model); parameter names are timm's.
FAMILIES = {
    "deit_small_distilled_patch16_224": (dict(img_size=32, patch_size=8), dict(dist_token=True, family="deit")),
    "vit_small_patch14_reg4_dinov2": (dict(img_size=28, patch_size=14),
                                      dict(reg_tokens=4, no_embed_class=True, init_values=1e-5, family="dinov2")),
    "vit_base_patch16_clip_224": (dict(img_size=32, patch_size=16),
                                  dict(norm_pre=True, patch_bias=False, layer_norm_eps=1e-5, family="clip")),
    "vit_base_patch16_siglip_224": (dict(img_size=32, patch_size=16),
                                    dict(class_token=False, pool="map", gelu="tanh", family="siglip")),
}


def _pair(arch: str) -> tuple[torch.nn.Module, VisionTransformer]:
    """timm's model (random weights) and ours with its state dict loaded (strict: the names are the same)."""
    timm_kw, ours = FAMILIES[arch]
    ref = timm.create_model(arch, pretrained=False, embed_dim=32, depth=2, num_heads=2, num_classes=10, **timm_kw)
    model = VisionTransformer(ViTConfig(embed_dim=32, depth=2, num_heads=2, mlp_dim=128, num_classes=10, **timm_kw,
                                        **ours))
    model.load_state_dict(ref.state_dict(), strict=True)
    return ref, model


def _per_param(model: torch.nn.Module, groups: list[dict]) -> dict[str, tuple[float, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_layer_decay_groups_equal_timm(arch):
    """Per parameter: lr scale R^(depth+1-layer) and weight decay as timm.optim.create_optimizer_v2(layer_decay=R)."""
    ref, model = _pair(arch)
    r, wd = 0.65, 0.05
    from timm.optim import create_optimizer_v2

    want = _per_param(ref, create_optimizer_v2(ref, "adamw", lr=1e-3, weight_decay=wd, layer_decay=r).param_groups)
    got = _per_param(model, layer_decay_groups(model, wd, r, depth=2))
    assert set(got) == set(want) == {n for n, _ in model.named_parameters()}
    # The one difference: timm's group_matcher puts the final `norm` with the last block (MATCH_PREV_GROUP),
    # MAE's param_groups_lrd and BEiT after the encoder (depth + 1), as we do.
    assert {n: want[n] for n in ("norm.weight", "norm.bias")} == {"norm.weight": (r, 0.0), "norm.bias": (r, 0.0)}
    diff = {n: (got[n], want[n]) for n in got if got[n] != want[n] and not n.startswith("norm.")}
    assert not diff, diff
    assert got["norm.weight"] == got["norm.bias"] == (1.0, 0.0)
    # MAE's util/lr_decay.py get_layer_id_for_vit and its no-decay rule (1-D or in no_weight_decay), as written there.
    num_layers = 2 + 1
    for n, p in model.named_parameters():
        if n in ["cls_token", "pos_embed", "dist_token", "reg_token"] or n.startswith("patch_embed") \
                or n.startswith("norm_pre"):  # MAE's list, with the tokens and norm_pre its models lack
            layer = 0
        elif n.startswith("blocks"):
            layer = int(n.split(".")[1]) + 1
        else:
            layer = num_layers
        mae_wd = 0.0 if p.ndim == 1 or n in ("pos_embed", "cls_token", "dist_token", "reg_token") else wd
        assert got[n] == (r ** (num_layers - layer), mae_wd), n
    scales = sorted({s for s, _ in got.values()})
    assert scales == [r**3, r**2, r, 1.0]  # embeddings, block 0, block 1, after the encoder
    assert got["pos_embed"] == (r**3, 0.0) and got["patch_embed.proj.weight"] == (r**3, wd)
    assert got["blocks.1.attn.qkv.weight"] == (r, wd) and got["head.weight"] == (1.0, wd)
    # Through the trainer's optimizer and schedule: each group at lr x lr_scale x the schedule's factor.
    cfg = TrainConfig(optimizer="adam", lr=0.1, weight_decay=wd, layer_decay=r, steps=10, warmup_steps=2)
    opt = build_optimizer(model, cfg, depth=2)
    sched = build_schedule(opt, cfg)
    opt.step()
    sched.step()
    assert all(g["lr"] == pytest.approx(0.1 * g["lr_scale"] * lr_factor(1, 10, 2, "cosine")) for g in opt.param_groups)


def test_layer_decay_of_clip_projection():
    """CLIP's bias-free `proj` (not a timm parameter: timm's head is the projection) is after the encoder."""
    model = VisionTransformer(ViTConfig(**{**TINY, "num_classes": 0}, proj_dim=16, norm_pre=True))
    got = _per_param(model, layer_decay_groups(model, 0.1, 0.5, depth=2))
    assert got["proj.weight"] == (1.0, 0.1) and got["norm_pre.weight"] == (0.125, 0.0)
    assert got["blocks.0.norm1.bias"] == (0.25, 0.0)


@pytest.mark.parametrize("exclude_buffers", [True, False])
def test_ema_equals_timm_model_ema_v3(exclude_buffers):
    """Bit for bit with timm.utils.ModelEmaV3 stepping on the same AdamW updates (decay 0.9, 5 steps)."""
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(**TINY, init_values=0.1, dist_token=True))
    ours, ref = ModelEMA(model, 0.9), ModelEmaV3(model, decay=0.9, exclude_buffers=exclude_buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(4, 3, 8, 8)).logsumexp(-1).mean() + model.pos_embed.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ours.update(model)
        ref.update(model)
    a, b, w = ours.state_dict(), ref.module.state_dict(), model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max((a[k] - w[k]).abs().max().item() for k in a) > 1e-4  # it is an average, not a copy


def deit_distillation_loss(outputs, labels, teacher_outputs, kind: str, alpha: float, tau: float):
    """facebookresearch/deit losses.py DistillationLoss.forward, base criterion CrossEntropyLoss, as written there."""
    outputs, outputs_kd = outputs
    base_loss = torch.nn.CrossEntropyLoss()(outputs, labels)
    if kind == "soft":
        T = tau
        distillation_loss = F.kl_div(F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                                     reduction="sum", log_target=True) * (T * T) / outputs_kd.numel()
    else:
        distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
    return base_loss * (1 - alpha) + distillation_loss * alpha


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, randomize):
    """A DeiT-style student (dist token, LayerScale, registers) and a plain teacher, random weights, digits labels."""
    d = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for name, extra, seed in (("student", dict(dist_token=True, init_values=0.5, reg_tokens=2), 0),
                              ("teacher", {}, 1), ("plain", {}, 2)):
        model = randomize(VisionTransformer(ViTConfig(**TINY, **extra)), seed=seed, head_std=1.0)
        model.labels = DIGITS
        paths[name] = vit_serve.save(model, d / f"{name}.safetensors")
    return paths


def _finetune(ckpts, out: Path, **kw) -> TrainConfig:
    base = dict(mode="finetune", init=str(ckpts["student"]), out=str(out), steps=6, batch_size=16, lr=0.01,
                warmup_steps=1, log_every=1, eval_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("kind,tau", [("hard", 1.0), ("soft", 2.0)])
def test_distillation_loss_is_deits(ckpts, tmp_path, one_thread, kind, tau):
    """The trainer's loss on a batch = DeiT's DistillationLoss on the student's (cls, dist) and the teacher's logits."""
    t = Trainer(_finetune(ckpts, tmp_path / kind, teacher=str(ckpts["teacher"]), distill=kind, distill_tau=tau))
    try:
        x, y = t._next_batch()
        t.net.train()
        got = t._loss(x, y)
        cls, dist = t.model(x)
        assert cls.shape == dist.shape == (16, 10) and not torch.equal(cls, dist)
        with torch.no_grad():
            teacher = vit_serve.load(ckpts["teacher"])(x)
        want = deit_distillation_loss((cls, dist), y, teacher, kind, 0.5, tau)
        print(f"{kind}: trainer {got.item():.6f}, DeiT {want.item():.6f}")
        assert abs(got.item() - want.item()) <= 1e-6 and got.item() > 0.1
    finally:
        t.log_file.close()


def test_onnx_teacher_equals_checkpoint_teacher(ckpts, tmp_path, one_thread):
    import vit_export

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = vit_export.export(ckpts["teacher"], vit_export.ExportOptions(out=tmp_path / "exp"), progress=print)
    finally:
        torch.set_num_threads(threads)
    onnx, ckpt = load_teacher(str(res.onnx), torch.device("cpu")), load_teacher(str(ckpts["teacher"]),
                                                                                 torch.device("cpu"))
    pre = vit_serve.load(ckpts["teacher"]).preprocess_cfg
    for t in (onnx, ckpt):
        t.fit_student(10, DIGITS, (8, 8), pre.mean, pre.std)
    x = torch.randn(5, 3, 8, 8)
    err = (onnx(x) - ckpt(x)).abs().max().item()
    print(f"ONNX teacher vs checkpoint teacher: max |Δ logit| {err:.2e}")
    assert err <= 1e-4
    with pytest.raises(OptionError, match="takes 8x8 inputs, the student trains at 12x12"):
        onnx.fit_student(10, DIGITS, (12, 12), pre.mean, pre.std)
    with pytest.raises(OptionError, match="has 10 classes, the data set 3"):
        ckpt.fit_student(3, ["a", "b", "c"], (8, 8), pre.mean, pre.std)
    runs = {}
    for name, teacher in (("onnx", res.onnx), ("ckpt", ckpts["teacher"])):
        train(_finetune(ckpts, tmp_path / name, steps=3, teacher=str(teacher), distill="soft"))
        runs[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r]
    print("losses, ONNX teacher:", runs["onnx"], "checkpoint teacher:", runs["ckpt"])
    assert max(abs(a - b) for a, b in zip(runs["onnx"], runs["ckpt"], strict=True)) <= 1e-5


def test_teacher_needs_a_dist_token(ckpts, tmp_path):
    out = tmp_path / "refused"
    exe = shutil.which("vit-serve")
    cmd = [exe] if exe else [sys.executable, "-m", "vit_serve"]
    r = subprocess.run([*cmd, "train", "--mode", "finetune", "--init", str(ckpts["plain"]), "--teacher",
                        str(ckpts["teacher"]), "--distill", "soft", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stderr)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "distillation token" in r.stderr and "plain.safetensors has none" in r.stderr
    assert not out.exists()  # nothing written
    with pytest.raises(OptionError, match="--distill needs --teacher"):
        TrainConfig(distill="hard")
    with pytest.raises(OptionError, match="--layer-decay must be in"):
        TrainConfig(layer_decay=1.5)


def test_resume_with_all_three_is_exact(ckpts, tmp_path, one_thread):
    """N steps straight = k steps, stop, resume, N - k (layer decay, EMA, soft distillation, dropout on): the
    weights and the EMA bit for bit, and the same losses."""
    kw = dict(layer_decay=0.75, ema_decay=0.8, teacher=str(ckpts["teacher"]), distill="soft", distill_tau=2.0,
              dropout=0.1, drop_path=0.1, optimizer="adam", eval_every=3)
    straight = train(_finetune(ckpts, tmp_path / "straight", **kw))
    t = Trainer(_finetune(ckpts, tmp_path / "split", **kw))
    t.t_start = t.t_log = time.perf_counter()  # what run() sets before its loop
    while t.state.step < 4:
        t.log(t.step())
        if t.state.step % 3 == 0:
            t.keep_if_best(t.evaluate())
    t.checkpoint()
    t.log_file.close()
    resumed = train(_finetune(ckpts, tmp_path / "split", resume=True, **kw))
    for name in ("model.safetensors", "model_ema.safetensors"):
        a, b = (vit_serve.load(tmp_path / run / name).state_dict() for run in ("straight", "split"))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    raw, ema = (vit_serve.load(tmp_path / "straight" / n).state_dict() for n in ("model.safetensors",
                                                                                 "model_ema.safetensors"))
    assert max((raw[k] - ema[k]).abs().max().item() for k in raw) > 1e-4
    losses = {run: {r["step"]: r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r}
              for run in ("straight", "split")}
    assert losses["straight"] == losses["split"] and sorted(losses["straight"]) == list(range(1, 7))
    assert all(math.isfinite(v) for v in losses["straight"].values())
    for key in ("top1", "top1_ema", "val_loss_ema"):
        assert straight[key] == resumed[key], key
    evals = [r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "val_top1_ema" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert (tmp_path / "straight" / "best_ema.safetensors").is_file()
    stored = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert stored["layer_decay"] == 0.75 and stored["ema_decay"] == 0.8 and stored["distill"] == "soft"
