"""`vit-serve train` end to end, on the embedded digits set and on image folders, on the CPU."""

import json
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
