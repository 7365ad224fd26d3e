"""The training loop: one flat function, `train(cfg)`.

Works the same on one CPU process, under torchrun (DDP: NCCL on GPU, gloo on CPU; on XLA torch_xla's own
process group and gradient all-reduce), on CUDA (bf16 autocast or fp16 with loss scaling, fused attention,
optional torch.compile and activation checkpointing) and through XLA. Every process draws its own dropout,
drop-path and Mixup / CutMix randomness from (seed, rank, step), and every process evaluates its share of the
validation set (the counts are summed), so no rank waits on another's evaluation. Every `ckpt_every` steps
the whole state is written atomically, so `--resume` continues a killed run with exactly the losses it would
have had.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import vit_serve
from vit_serve.checkpoints import load as load_checkpoint
from vit_serve.config import ViTConfig, get_config
from vit_serve.data import build_dataset, collate_skip
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig
from vit_serve.train import distributed, xla
from vit_serve.train.augment import MixupCutmix, eval_transform, soft_target_cross_entropy, train_transform
from vit_serve.train.config import DIGITS_MODEL, TrainConfig
from vit_serve.train.eval_checkpoint import few_shot_on
from vit_serve.train.evaluate import evaluate, save_confusion_png
from vit_serve.train.mpp import MPPModel, denormalize, mpp_targets
from vit_serve.train.progress import MetricsLog, Progress, plot_curves, read_metrics, summary_table
from vit_serve.train.recipes import build_optimizer, build_schedule
from vit_serve.train.seeded import SeededTransform, seed_step
from vit_serve.train.state import load_state, save_state, set_rng_state


class TrainingError(ValueError):
    """A run that cannot go on (a setup that does not fit, or a diverged loss); the message says why."""


def _raw(image):
    return image


def device_type(name: str) -> str:
    """"cpu", "cuda" or "xla" for --device NAME, checked, without touching the device."""
    if name == "xla":
        if not xla.available():
            raise TrainingError("--device xla needs torch_xla (pip install -e '.[tpu]' with its matching torch)")
        return name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("--device cuda, but no CUDA device is available")
    return name


def resolve_device(name: str) -> torch.device:
    kind = device_type(name)
    if kind == "xla":
        return xla.device()
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(kind)


def build_model(cfg: TrainConfig, classes: list[str]) -> VisionTransformer:
    """pretrain: a fresh model from a preset; finetune: the --init checkpoint at --res, with a new zero head
    unless the dataset's classes are the checkpoint's own (then the trained head is kept)."""
    num_classes = len(classes)
    regularisers = dict(drop_rate=cfg.dropout, attn_drop_rate=cfg.attn_dropout, drop_path_rate=cfg.drop_path)
    if cfg.mode == "pretrain":
        base = ViTConfig(**DIGITS_MODEL) if cfg.model == "digits" else get_config(cfg.model)
        vcfg = base.replace(num_classes=0 if cfg.objective == "mpp" else num_classes,
                            representation_size=cfg.representation_size, **regularisers, **cfg.model_args)
        if cfg.res:
            vcfg = vcfg.replace(img_size=cfg.res)
        model = VisionTransformer(vcfg)
        digits = cfg.data == "digits"
        model.preprocess_cfg = PreprocessConfig(input_size=vcfg.img_size, crop_pct=1.0 if digits else 0.9)
        return model
    init = load_checkpoint(cfg.init)
    # Rebuild so that dropout settings apply; the weights are carried over unchanged.
    model = VisionTransformer(init.cfg.replace(**regularisers, **cfg.model_args))
    model.load_state_dict(init.state_dict())
    model.preprocess_cfg, model.labels = init.preprocess_cfg, init.labels
    new_head = cfg.new_head if cfg.new_head is not None else list(init.labels or []) != list(classes)
    if new_head:
        model.reset_head(num_classes)  # paper §3.2: drop the head (and pre-logits), zero-initialised D x K
    if cfg.res:
        model.set_resolution(*cfg.res)  # 2-D interpolation of the position embeddings, checkpoint's mode
    if cfg.reinit_pos_embed:  # the control of the resolution-transfer experiment
        model.reset_pos_embed()
    return model


def _batches(loader: DataLoader, sampler, dataset: SeededTransform, epoch: int, start: int):
    """Micro-batches from (epoch, start) onwards, forever; yields (epoch, index in epoch, x, y, skipped)."""
    while True:
        sampler.set_position(epoch, start)
        dataset.set_epoch(epoch)
        for i, (x, y, skipped) in enumerate(loader, start=start // loader.batch_size):
            yield epoch, i + 1, x, y, skipped
        epoch, start = epoch + 1, 0


def train(cfg: TrainConfig) -> dict[str, Any]:
    rank, world = distributed.setup(device_type(cfg.device))  # first: XLA's rendezvous sets up its runtime
    device = resolve_device(cfg.device)
    is_main = rank == 0
    out = Path(cfg.out)
    state_path = out / "checkpoints" / "last.pt"
    if state_path.exists() and not cfg.resume:  # every rank: none may wait on a rank that stopped
        raise TrainingError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    random.seed(cfg.seed)  # the same on every rank: identical initial weights
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    micro, rem = divmod(cfg.batch_size, cfg.accum_steps * world)
    if rem or micro == 0:
        raise TrainingError(f"batch size {cfg.batch_size} does not split into {cfg.accum_steps} accumulation "
                            f"steps x {world} processes")
    train_base = build_dataset(cfg.data, "train", _raw, strict=cfg.strict)
    num_classes = len(train_base.classes)
    model = build_model(cfg, list(train_base.classes))
    model.labels = list(train_base.classes) if cfg.objective == "classify" else None
    pre = model.preprocess_cfg
    model.grad_checkpointing = cfg.grad_checkpointing
    if device.type == "xla" and xla.hardware(device) == "TPU":
        try:
            xla.use_pallas_attention(model)
        except ImportError as e:
            raise TrainingError(str(e)) from None
    model.to(device)

    augment = train_transform(pre, cfg.inception_crop, cfg.flip, cfg.randaugment, cfg.translate)
    train_ds = SeededTransform(train_base, augment, cfg.seed)
    val_ds = build_dataset(cfg.data, "test", eval_transform(pre), strict=cfg.strict)
    sampler = distributed.ResumableSampler(train_ds, world, rank, cfg.seed)
    pin = device.type == "cuda"
    # Own generators: a DataLoader otherwise draws its worker seed from the global RNG each time an epoch
    # starts, which would shift every later dropout mask of a resumed run.
    loader = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=cfg.workers, drop_last=True,
                        collate_fn=collate_skip, pin_memory=pin, generator=torch.Generator().manual_seed(cfg.seed))
    val_loader = DataLoader(val_ds, batch_size=micro, sampler=distributed.ShardSampler(len(val_ds), world, rank),
                            num_workers=cfg.workers, collate_fn=collate_skip, pin_memory=pin,
                            generator=torch.Generator().manual_seed(cfg.seed))
    if len(sampler) < micro:
        raise TrainingError(f"the training set ({len(train_ds)} images) is smaller than one batch per process")

    net: torch.nn.Module = MPPModel(model, ratio=cfg.mpp_ratio).to(device) if cfg.objective == "mpp" else model
    optimizer = build_optimizer(net, cfg)
    schedule = build_schedule(optimizer, cfg)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    if amp_dtype is not None and device.type != "cuda":
        raise TrainingError(f"--precision {cfg.precision} needs a CUDA device; use fp32 here")
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
    mix = MixupCutmix(num_classes, cfg.mixup, cfg.cutmix, cfg.label_smoothing) if cfg.mixup or cfg.cutmix else None

    step, epoch, start, best = 0, 0, 0, -1.0
    if cfg.resume and state_path.exists():
        st = load_state(state_path)
        net.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        schedule.load_state_dict(st["schedule"])
        scaler.load_state_dict(st["scaler"])
        step, epoch, start, best = st["step"], st["epoch"], st["index_in_epoch"] * micro, st["best"]
        set_rng_state(st["rng"])
        if is_main:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
            print(f"resuming at step {step} of {cfg.steps} from {state_path}"
                  + (f" (torchrun restart {restart})" if restart else ""), flush=True)
    # Every rank reads the state itself: ranks that found different ones (a node-local --out on several
    # machines) would run different numbers of steps into a deadlock. The sum over the ranks equals
    # world x own step on every rank only when all the steps are equal.
    if world > 1 and int(distributed.sum_across(torch.tensor(step, device=device)).item()) != world * step:
        raise TrainingError(f"the processes found different training states at {state_path} (this one: "
                            f"{'step ' + str(step) if step else 'none'}); with several machines --out must be a "
                            "folder every machine sees at the same path (shared storage)")
    trunk = net
    if world > 1 and device.type != "xla":  # on XLA, torch_xla all-reduces the gradients (xla.reduce_gradients)
        trunk = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if pin else None,
                                                          find_unused_parameters=cfg.objective == "mpp")
    if cfg.compile:
        trunk = torch.compile(trunk)

    if is_main and (hazard := distributed.restart_hazard()):
        print(f"warning: {hazard}", file=sys.stderr, flush=True)
    log = MetricsLog(out, enabled=is_main)
    if is_main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    progress = Progress(cfg.steps, step, enabled=is_main and cfg.progress)
    batches = _batches(loader, sampler, train_ds, epoch, start)

    def run_eval() -> dict[str, Any]:
        """Every rank scores its shard; the counts are summed, so every rank gets the whole set's result."""
        res = evaluate(model, val_loader, device=device, amp_dtype=amp_dtype, num_classes=num_classes,
                       reduce=distributed.sum_across)
        rec = {"step": step, "val_top1": res["top1"], "val_top5": res["top5"], "val_loss": res["loss"]}
        log.write(rec)
        return res

    def save_all() -> None:
        if is_main:
            save_state(state_path, model=net.state_dict(), optimizer=optimizer.state_dict(),
                       schedule=schedule.state_dict(), scaler=scaler.state_dict(), step=step, epoch=epoch,
                       index_in_epoch=index, best=best, config=cfg.to_dict())
        distributed.barrier()

    if cfg.eval_at_start and cfg.objective == "classify" and step == 0:
        first = run_eval()
        if is_main:
            print(f"before training: top-1 {100 * first['top1']:.2f}%", flush=True)

    t_start = time.perf_counter()
    t_log, images_since_log, images_total, skipped_total, index = t_start, 0, 0, 0, start // micro
    while step < cfg.steps:
        seed_step(cfg.seed, rank, step, device)  # a resumed run draws what an uninterrupted one would
        net.train()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for m in range(cfg.accum_steps):
            x = None
            while x is None:  # a batch whose every image was unreadable is skipped
                epoch, index, x, y, skipped = next(batches)
                skipped_total += skipped
            x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
            last = m == cfg.accum_steps - 1
            sync = trunk.no_sync() if not last and hasattr(trunk, "no_sync") else contextlib.nullcontext()
            with sync, torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                if cfg.objective == "mpp":
                    targets = mpp_targets(denormalize(x, pre.mean, pre.std), model.cfg.patch_size)
                    loss = trunk(x, targets)
                elif mix is not None:
                    x, y_soft = mix(x, y)
                    loss = soft_target_cross_entropy(trunk(x), y_soft)
                else:
                    loss = F.cross_entropy(trunk(x), y, label_smoothing=cfg.label_smoothing)
                scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach() / cfg.accum_steps
            images_since_log += x.shape[0] * world

        if device.type != "xla":  # on XLA the check waits for a log step: no host sync per step
            loss_value = distributed.mean_across(loss_sum).item()
            if not math.isfinite(loss_value):
                raise TrainingError(f"loss is {loss_value} at step {step + 1}; stopping. The last good "
                                    f"checkpoint is intact: {state_path if state_path.exists() else 'none yet'}")
        if device.type == "xla":
            xla.reduce_gradients(optimizer)  # before clipping, as DDP's all-reduce is
        if cfg.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        if device.type == "xla":
            optimizer.step()
            xla.sync()
        else:
            scaler.step(optimizer)
            scaler.update()
        schedule.step()
        step += 1

        if step % cfg.log_every == 0 or step == cfg.steps:
            loss_value = distributed.mean_across(loss_sum).item()
            if not math.isfinite(loss_value):
                raise TrainingError(f"loss is {loss_value} at step {step}; stopping")
            now = time.perf_counter()
            ips = images_since_log / max(now - t_log, 1e-9)
            images_total += images_since_log
            lr = optimizer.param_groups[0]["lr"]
            skipped_all = int(distributed.sum_across(torch.tensor(skipped_total, device=device)).item())
            log.write({"step": step, "epoch": epoch, "loss": loss_value, "lr": lr, "images_per_s": ips,
                       "skipped": skipped_all})
            progress.update(step, cfg.log_every if step % cfg.log_every == 0 else step % cfg.log_every,
                            loss=loss_value, lr=lr, img_s=ips)
            t_log, images_since_log = now, 0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and cfg.objective == "classify":
            res = run_eval()
            if res["top1"] > best:
                best = res["top1"]
                if is_main:
                    vit_serve.save(model, out / "best.safetensors", overwrite=True)
        if cfg.ckpt_every and step % cfg.ckpt_every == 0:
            save_all()
    progress.close()
    wall = time.perf_counter() - t_start
    save_all()

    summary: dict[str, Any] = {"steps": step, "wall_s": wall, "images_per_s": images_total / max(wall, 1e-9),
                               "skipped": skipped_total, "world_size": world}
    if cfg.objective == "classify":
        res = run_eval()
        summary.update(top1=res["top1"], top5=res["top5"], val_loss=res["loss"], val_images=res["n"])
    if is_main:
        if cfg.objective == "classify":
            if res["top1"] > best:
                vit_serve.save(model, out / "best.safetensors", overwrite=True)
            save_confusion_png(res["confusion"], model.labels or [], out / "confusion.png",
                               f"validation, step {step}: top-1 {100 * res['top1']:.2f}%")
        if cfg.few_shot:
            summary["few_shot"] = few_shot_on(model, cfg.data, cfg.few_shot, cfg.seed, device)
        vit_serve.save(model, out / "model.safetensors", overwrite=True,
                       extra_metadata={"train_config": cfg.to_dict(), "summary": summary})
        plot_curves(read_metrics(log.path), out / "curves.png", f"{cfg.mode} on {cfg.data}")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        rows = {"top-1": f"{100 * summary['top1']:.2f}%", "top-5": f"{100 * summary['top5']:.2f}%"} \
            if "top1" in summary else {}
        rows.update({"images/s": f"{summary['images_per_s']:.1f}", "wall time": f"{wall:.1f} s",
                     "steps": str(step), "skipped images": str(skipped_total), "model": str(out / "model.safetensors")})
        print(summary_table(rows), flush=True)
    log.close()
    distributed.teardown()
    return summary

