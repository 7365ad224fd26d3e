"""`vit-serve train` end to end, on the embedded digits set and on image folders, on the CPU."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

import vit_serve
from vit_serve.train.config import TrainConfig
from vit_serve.train.loop import train
from vit_serve.train.progress import read_metrics

TINY = ["--model-args", "depth=2,embed_dim=32,num_heads=2,mlp_dim=64,patch_size=2", "--res", "8", "--no-progress"]


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    exe = shutil.which("vit-serve")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "vit_serve", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kw)


def losses(out: Path) -> dict[int, float]:
    """step -> loss; a resumed run rewrites steps it logged before the kill, so the last record wins."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


def test_digits_run_writes_everything(tmp_path):
    out = tmp_path / "run"
    r = cli("train", "--out", str(out), "--steps", "40", "--batch-size", "32", "--log-every", "5",
            "--eval-every", "20", "--lr", "0.003", "--warmup-steps", "5", "--translate", "0", "--dropout", "0", *TINY)
    assert r.returncode == 0, r.stderr
    assert "top-1" in r.stdout and "images/s" in r.stdout and "wall time" in r.stdout
    for name in ("model.safetensors", "best.safetensors", "checkpoints/last.pt", "metrics.jsonl", "curves.png",
                 "confusion.png", "summary.json", "config.json"):
        assert (out / name).is_file(), name
    log = losses(out)
    assert log[40] < log[5]  # it learns
    model = vit_serve.load(out / "model.safetensors")
    assert model.cfg.img_size == (8, 8) and model.cfg.depth == 2 and model.labels == [str(i) for i in range(10)]
    assert model.preprocess_cfg.crop_pct == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert 0.2 < summary["top1"] <= 1.0 and summary["skipped"] == 0
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = json.loads(f.metadata()["train_config"])
    assert stored["steps"] == 40 and stored["lr"] == 0.003  # the resolved config travels with the weights
    # The same folder again without --resume is refused: nothing is overwritten silently.
    again = cli("train", "--out", str(out), "--steps", "2", *TINY)
    assert again.returncode == 1 and "already holds a run; pass --resume" in again.stderr


def test_resume_after_sigkill_gives_identical_losses(tmp_path):
    args = ["--steps", "30", "--batch-size", "16", "--log-every", "1", "--ckpt-every", "10", "--lr", "0.003",
            "--dropout", "0.1", *TINY]
    ref = tmp_path / "ref"
    assert cli("train", "--out", str(ref), *args).returncode == 0
    out = tmp_path / "killed"
    exe = shutil.which("vit-serve")
    cmd = [exe] if exe else [sys.executable, "-m", "vit_serve"]
    proc = subprocess.Popen([*cmd, "train", "--out", str(out), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = out / "checkpoints" / "last.pt"
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(state, weights_only=True)["step"]
    assert killed_at < 30
    r = cli("train", "--out", str(out), "--resume", *args)
    assert r.returncode == 0, r.stderr
    want, got = losses(ref), losses(out)
    assert sorted(got) == list(range(1, 31))
    assert all(got[s] == want[s] for s in range(1, 31)), [(s, got[s], want[s]) for s in got if got[s] != want[s]]


def test_ddp_two_processes_match_one(tmp_path):
    """2 processes (gloo) x 16 images equal 1 process x 32 images per step, to 1e-4."""
    args = ["--steps", "5", "--batch-size", "32", "--log-every", "1", "--lr", "0.003", "--dropout", "0", *TINY]
    one = tmp_path / "one"
    assert cli("train", "--out", str(one), *args).returncode == 0
    two = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "vit_serve", "train", "--out", str(two), *args], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(one), losses(two)
    print("1 process:", a, "\n2 processes:", b)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-4


def test_diverging_run_stops_with_checkpoint_intact(tmp_path):
    out = tmp_path / "nan"
    r = cli("train", "--out", str(out), "--steps", "50", "--batch-size", "16", "--lr", "1e12", "--warmup-steps", "0",
            "--ckpt-every", "1", "--grad-clip", "0", *TINY)
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert "loss is nan" in line or "loss is inf" in line
    assert "last good checkpoint is intact" in line
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    assert not (out / "model.safetensors").exists()


def _folder(root: Path) -> None:
    from skimage import data

    photos = {"cat": data.chelsea(), "astronaut": data.astronaut(), "coffee": data.coffee()}
    for split in ("train", "val"):
        for name, arr in photos.items():
            d = root / split / name
            d.mkdir(parents=True)
            for k in range(4):
                Image.fromarray(arr).rotate(10 * k).save(d / f"{k}.jpg")
    (root / "train" / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")


def test_image_folder_with_a_corrupt_file(tmp_path):
    _folder(tmp_path / "imgs")
    out = tmp_path / "run"
    summary = train(TrainConfig(data=str(tmp_path / "imgs"), out=str(out), steps=6, batch_size=4, log_every=1,
                                res=(16, 16), model_args=dict(depth=1, embed_dim=32, num_heads=2, mlp_dim=64,
                                                              patch_size=8), progress=False))
    assert summary["skipped"] >= 1
    assert read_metrics(out / "metrics.jsonl")[-2]["skipped"] >= 1
    assert vit_serve.load(out / "model.safetensors").labels == ["astronaut", "cat", "coffee"]
    with pytest.raises(ValueError, match=r"broken\.jpg"):
        train(TrainConfig(data=str(tmp_path / "imgs"), out=str(tmp_path / "strict"), steps=12, batch_size=4,
                          res=(16, 16), strict=True, progress=False,
                          model_args=dict(depth=1, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=8)))


def test_mpp_pretraining_then_finetune(tmp_path):
    out = tmp_path / "mpp"
    summary = train(TrainConfig(objective="mpp", out=str(out), steps=60, batch_size=32, lr=0.003, log_every=10,
                                warmup_steps=5, res=(8, 8), progress=False,
                                model_args=dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=2)))
    log = losses(out)
    assert log[60] < 0.8 * log[10], log
    assert "top1" not in summary
    ft = train(TrainConfig(mode="finetune", init=str(out / "model.safetensors"), out=str(tmp_path / "ft"),
                           steps=5, batch_size=32, log_every=1, progress=False))
    assert 0 <= ft["top1"] <= 1
    assert vit_serve.load(tmp_path / "ft" / "model.safetensors").cfg.num_classes == 10


def test_xla_cpu_steps(tmp_path):
    """Runs where torch_xla is installed (the [tpu] extra), on the CPU through XLA: PJRT_DEVICE=CPU."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e '.[tpu]')")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    out = tmp_path / "xla"
    summary = train(TrainConfig(device="xla", out=str(out), steps=8, batch_size=16, log_every=2, lr=0.003,
                                warmup_steps=1, res=(8, 8), progress=False,
                                model_args=dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=2)))
    log = losses(out)
    assert sorted(log) == [2, 4, 6, 8] and all(v == v for v in log.values())
    assert log[8] < log[2] and 0 <= summary["top1"] <= 1


def test_eval_command(tmp_path):
    out = tmp_path / "run"
    assert cli("train", "--out", str(out), "--steps", "20", "--batch-size", "32", "--lr", "0.003",
               *TINY).returncode == 0
    r = cli("eval", str(out / "model.safetensors"), "--out", str(tmp_path / "ev"), "--few-shot", "1,5")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert 0 <= result["top1"] <= result["top5"] <= 1 and set(result["few_shot"]) == {"1", "5"}
    assert (tmp_path / "ev" / "confusion.png").is_file()
    r = cli("eval", str(out / "model.safetensors"), "--res", "12")
    assert r.returncode == 0 and json.loads(r.stdout)["resolution"] == [12, 12]
    r = cli("eval", str(out / "model.safetensors"), "--res", "13")
    assert r.returncode == 1 and "input size 13x13 is not a multiple of the patch size 2" in r.stderr


# Options that change how a step is computed but not what it computes: each against the plain loop.
SMALL = dict(model_args=dict(depth=2, embed_dim=32, num_heads=2, mlp_dim=64, patch_size=2), res=(8, 8),
             progress=False, eval_every=0, log_every=1, lr=0.003, warmup_steps=1)


def _run(tmp_path, name: str, **kw) -> dict[int, float]:
    cfg = {**SMALL, "steps": 4, "batch_size": 32, "dropout": 0.0, **kw}
    train(TrainConfig(out=str(tmp_path / name), **cfg))
    return losses(tmp_path / name)


def _weights(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return vit_serve.load(tmp_path / name / "model.safetensors").state_dict()


def test_accum_steps_equal_one_big_batch(tmp_path, one_thread):
    one = _run(tmp_path, "one")
    for accum in (2, 4):
        got = _run(tmp_path, f"accum{accum}", accum_steps=accum)
        print(f"accum {accum}: max |Δ loss| {max(abs(got[s] - one[s]) for s in one):.2e}")
        assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - one[s]) for s in one) <= 1e-5
        w1, w2 = _weights(tmp_path, "one"), _weights(tmp_path, f"accum{accum}")
        assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-4  # Adam: lr 3e-3 per step


def test_grad_checkpointing_recomputes_the_same_step(tmp_path, one_thread, monkeypatch):
    import vit_serve.model

    calls = []
    real = vit_serve.model.checkpoint
    monkeypatch.setattr(vit_serve.model, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    reg = dict(dropout=0.1, drop_path=0.2)  # the recomputation must replay the same dropout masks
    plain = _run(tmp_path, "plain", **reg)
    assert not calls
    ckpt = _run(tmp_path, "ckpt", grad_checkpointing=True, **reg)
    assert len(calls) == 4 * 2  # every block of every step
    print(f"grad checkpointing: max |Δ loss| {max(abs(ckpt[s] - plain[s]) for s in plain):.2e}")
    assert max(abs(ckpt[s] - plain[s]) for s in plain) <= 1e-6


def test_loader_workers_give_the_same_losses(tmp_path, one_thread):
    assert _run(tmp_path, "w0", dropout=0.1) == _run(tmp_path, "w2", dropout=0.1, workers=2)


def test_mixup_cutmix_and_randaugment_through_the_loop(tmp_path, one_thread, monkeypatch):
    import vit_serve.train.loop as loop

    soft = []
    real = loop.soft_target_cross_entropy
    monkeypatch.setattr(loop, "soft_target_cross_entropy",
                        lambda logits, y: soft.append(float(y.max(dim=1).values.min())) or real(logits, y))
    plain = _run(tmp_path, "plain")
    mixed = _run(tmp_path, "mixed", mixup=0.8, cutmix=1.0)
    assert len(soft) == 4 and min(soft) < 0.99  # mixed (not one-hot) targets reached the loss
    rand = _run(tmp_path, "rand", randaugment="rand-m9-n2")
    print(f"step-4 loss: plain {plain[4]:.4f}, mixup+cutmix {mixed[4]:.4f}, RandAugment {rand[4]:.4f}")
    for got in (mixed, rand):  # step 1 is ln 10 for all (zero head); then other inputs or targets, other losses
        assert all(math.isfinite(v) for v in got.values()) and all(got[s] != plain[s] for s in (2, 3, 4))
    assert TrainConfig.from_dict(json.loads((tmp_path / "rand" / "config.json").read_text())).randaugment \
        == "rand-m9-n2"


def test_compile_gives_the_eager_losses(tmp_path, one_thread):
    import torch._dynamo

    eager = _run(tmp_path, "eager", steps=3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _run(tmp_path, "compiled", steps=3, compile=True)
    counters = torch._dynamo.utils.counters
    print({k: dict(v) for k, v in counters.items() if k in ("stats", "aot_autograd", "inductor")})
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["total"] >= 1  # compiled
    print(f"--compile: max |Δ loss| vs eager {max(abs(compiled[s] - eager[s]) for s in eager):.2e}")
    assert max(abs(compiled[s] - eager[s]) for s in eager) <= 1e-4


def _start_eval(out: Path) -> dict:
    (first,) = [r for r in read_metrics(out / "metrics.jsonl") if r.get("step") == 0 and "val_top1" in r]
    return first


def test_representation_size_new_head_and_reinit_pos_embed(tmp_path, one_thread):
    from vit_serve.data import build_dataset
    from vit_serve.train.augment import eval_transform

    pre = tmp_path / "pre"
    summary = train(TrainConfig(out=str(pre), **{**SMALL, "steps": 40, "batch_size": 32, "representation_size": 16}))
    ckpt = vit_serve.load(pre / "model.safetensors")
    assert ckpt.cfg.representation_size == 16 and ckpt.pre_logits[0].weight.shape == (16, 32)
    assert ckpt.head.weight.shape == (10, 16) and summary["top1"] > 0.1
    resampled = vit_serve.load(pre / "model.safetensors")
    resampled.set_resolution(12, 12)
    frozen = dict(mode="finetune", init=str(pre / "model.safetensors"), res=(12, 12), steps=1, batch_size=32,
                  lr=0.0, eval_at_start=True, eval_every=0, progress=False)

    # Same classes: by default the trained head and its pre-logits are kept, the embeddings resampled.
    keep = tmp_path / "keep"
    train(TrainConfig(out=str(keep), **frozen))
    kept = vit_serve.load(keep / "model.safetensors")
    assert kept.cfg.representation_size == 16 and torch.equal(kept.head.weight, ckpt.head.weight)
    assert torch.equal(kept.pos_embed, resampled.pos_embed)
    from torch.utils.data import DataLoader

    from vit_serve.data import collate_skip
    from vit_serve.train.evaluate import evaluate

    val = build_dataset("digits", "test", eval_transform(resampled.preprocess_cfg))
    direct = evaluate(resampled, DataLoader(val, batch_size=64, collate_fn=collate_skip))
    assert _start_eval(keep)["val_top1"] == direct["top1"]

    # --new-head: a zero head (paper §3.2, pre-logits dropped): uniform softmax, loss ln 10, one class picked;
    # --reinit-pos-embed: fresh N(0, 0.02) position embeddings instead of the resampled ones.
    new = tmp_path / "new"
    train(TrainConfig(out=str(new), new_head=True, reinit_pos_embed=True, **frozen))
    fresh = vit_serve.load(new / "model.safetensors")
    assert fresh.cfg.representation_size is None and not fresh.head.weight.any() and fresh.head.weight.shape == (10, 32)
    labels = [y for _, y in val]
    start = _start_eval(new)
    assert start["val_loss"] == pytest.approx(math.log(10), rel=1e-6)
    assert any(start["val_top1"] == pytest.approx(labels.count(c) / len(labels)) for c in range(10))
    assert fresh.pos_embed.shape == resampled.pos_embed.shape
    assert (fresh.pos_embed - resampled.pos_embed).abs().max() > 0.1
    assert 0.015 < fresh.pos_embed.std().item() < 0.025
