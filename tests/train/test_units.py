"""Recipes, training state, per-sample seeding, the resumable sampler and the run config."""

import json
import math
import random

import numpy as np
import pytest
import torch

import vit_serve
from vit_serve.train.config import TrainConfig, resolve
from vit_serve.train.distributed import ResumableSampler
from vit_serve.train.recipes import build_optimizer, lr_factor, param_groups
from vit_serve.train.seeded import SeededTransform
from vit_serve.train.state import load_state, rng_state, save_state, set_rng_state


def test_lr_schedule_warmup_then_cosine_or_linear():
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0)
    assert lr_factor(55, 100, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, "linear", min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(32, 100, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 22 / 90)))


def test_weight_decay_only_on_kernels_and_recipes():
    model = vit_serve.create_model("Ti/16", depth=1, img_size=32, num_classes=3)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} >= {"pos_embed", "cls_token", "blocks.0.norm1.weight",
                                                           "blocks.0.attn.qkv.bias"}
    assert {names[id(p)] for p in decay["params"]} == {
        "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
        "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight", "head.weight"}
    pre = build_optimizer(model, TrainConfig())
    assert isinstance(pre, torch.optim.AdamW) and pre.param_groups[0]["weight_decay"] == 0.1
    # RoPE-mixed's learned frequencies: no decay (timm's no_weight_decay), the head's layer (timm's group_matcher
    # matches them to none)
    from vit_serve.config import RopeConfig
    from vit_serve.train.recipes import layer_id

    mixed = vit_serve.create_model("Ti/16", depth=2, img_size=32, rope=RopeConfig("mixed", 10.0, grid_indexing="xy"))
    _, no_decay = param_groups(mixed, 0.1)
    assert any(p is mixed.rope.freqs for p in no_decay["params"]) and layer_id("rope.freqs", 2) == 3
    assert pre.defaults["betas"] == (0.9, 0.999)
    fine = build_optimizer(model, TrainConfig(mode="finetune", init="x.safetensors"))
    assert isinstance(fine, torch.optim.SGD) and fine.defaults["momentum"] == 0.9
    assert fine.param_groups[0]["weight_decay"] == 0.0 and fine.defaults["lr"] == 0.01


def test_rng_state_round_trip_and_weights_only_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    path = save_state(tmp_path / "last.pt", step=7, model={"w": torch.ones(2)})
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    loaded = load_state(path)  # weights_only=True: no arbitrary objects in the file
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], torch.ones(2))


class _Items(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return (None if i == 3 else (torch.zeros(2), i))


def test_seeded_transform_is_per_sample_deterministic():
    ds = SeededTransform(_Items(), lambda x: x + torch.rand(2), seed=5)
    a = [ds[i] for i in (0, 1, 2)]
    torch.rand(100)  # the global RNG does not matter
    b = [ds[i] for i in (2, 1, 0)][::-1]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    ds.set_epoch(1)
    assert not torch.equal(ds[0][0], a[0][0])
    assert ds[3] is None


def test_resumable_sampler_skips_exactly():
    ds = list(range(50))
    full = ResumableSampler(ds, num_replicas=2, rank=1, seed=3)
    full.set_position(epoch=4, start=0)
    part = ResumableSampler(ds, num_replicas=2, rank=1, seed=3)
    part.set_position(epoch=4, start=10)
    assert list(part) == list(full)[10:] and len(part) == len(full) - 10
    ref = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, seed=3, drop_last=True)
    ref.set_epoch(4)
    assert list(full) == list(ref)


def test_config_file_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('steps = 30\nlr = 0.002\nres = 24\nfew_shot = [1, 5]\n[model_args]\ndepth = 2\n')
    cfg = resolve(f, {"steps": 12, "lr": None})
    assert (cfg.steps, cfg.lr, cfg.res, cfg.few_shot, cfg.model_args) == (12, 0.002, (24, 24), (1, 5), {"depth": 2})
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="unknown training options: bogus"):
        resolve(j, {})
    with pytest.raises(ValueError, match="--mode finetune needs --init"):
        TrainConfig(mode="finetune")
    with pytest.raises(ValueError, match="batch_size 10 is not divisible by accum_steps 4"):
        TrainConfig(batch_size=10, accum_steps=4)
    assert TrainConfig().flip is False and TrainConfig(data="/imgs").flip is True
