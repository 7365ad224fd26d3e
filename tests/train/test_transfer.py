"""Resolution transfer, the paper's §3.2, at small sizes: pre-train on digits at 16x16, move to 32x32.

The functional proof that position-embedding resampling works: right after resampling, before any step,
the model is far more accurate than the same model with freshly initialised position embeddings; a short
fine-tune at the new resolution then recovers the pre-training accuracy. (benchmarks/digits_transfer.py
runs the same at full size.)
"""

import pytest
import torch

import vit_serve
from vit_serve.train.config import TrainConfig
from vit_serve.train.eval_checkpoint import run_eval
from vit_serve.train.loop import train
from vit_serve.train.progress import read_metrics


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits16")
    # The digits default with 4x4 patches (a 4x4 grid at 16x16, 8x8 at 32x32) and no shifts: small and quick.
    summary = train(TrainConfig(out=str(out), steps=600, progress=False, log_every=100, translate=0.0,
                                model_args={"patch_size": 4}))
    return out / "model.safetensors", summary


def test_resampled_position_embeddings_beat_fresh_ones_by_20_points(pretrained, tmp_path):
    ckpt, summary = pretrained
    resampled = run_eval(str(ckpt), res=(32, 32))["top1"]
    model = vit_serve.load(ckpt)
    model.set_resolution(32, 32)
    torch.manual_seed(0)
    model.reset_pos_embed()
    fresh = run_eval(str(vit_serve.save(model, tmp_path / "fresh.safetensors")))["top1"]
    print(f"16x16: {summary['top1']:.3f}; at 32x32 before any step: resampled {resampled:.3f}, fresh {fresh:.3f}")
    assert summary["top1"] >= 0.9
    assert resampled >= fresh + 0.20


def test_short_finetune_at_twice_the_resolution(pretrained, tmp_path):
    ckpt, summary = pretrained
    ft = train(TrainConfig(mode="finetune", init=str(ckpt), res=(32, 32), out=str(tmp_path / "ft"), steps=150,
                           eval_at_start=True, progress=False, log_every=50, translate=0.0))
    model = vit_serve.load(tmp_path / "ft" / "model.safetensors")
    assert model.cfg.img_size == (32, 32) and model.preprocess_cfg.input_size == (32, 32)
    assert model.labels == [str(i) for i in range(10)]  # same classes: the trained head was kept
    start = read_metrics(tmp_path / "ft" / "metrics.jsonl")[0]
    assert start["step"] == 0
    print(f"at 32x32: {start['val_top1']:.3f} before any step, {ft['top1']:.3f} after 150 fine-tuning steps "
          f"(pre-trained at 16x16: {summary['top1']:.3f})")
    assert ft["top1"] >= start["val_top1"] + 0.25
    # measured: 0.955 from 0.969 with one seed for the whole run; 0.939 from 0.975 with per-step seeds
    assert ft["top1"] >= summary["top1"] - 0.05
