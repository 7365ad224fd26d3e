"""The training loop: a `Trainer` of small steps, and `train(cfg)`, which runs one.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import vit_serve
from vit_serve.checkpoints import load as load_checkpoint
from vit_serve.data import build_dataset, collate_skip
from vit_serve.model import VisionTransformer
from vit_serve.preprocess import PreprocessConfig
from vit_serve.train import distributed, xla
from vit_serve.train.augment import MixupCutmix, eval_transform, soft_target_cross_entropy, train_transform
from vit_serve.train.config import OptionError, TrainConfig, data_recipe, model_preset
from vit_serve.train.distill import Teacher, distillation_loss, load_teacher
from vit_serve.train.ema import ModelEMA
from vit_serve.train.eval_checkpoint import few_shot_on
from vit_serve.train.evaluate import EvalResult, evaluate, save_confusion_png
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
        vcfg = model_preset(cfg.model).replace(num_classes=0 if cfg.objective == "mpp" else num_classes,
                            representation_size=cfg.representation_size, **regularisers, **cfg.model_args)
        if cfg.res:
            vcfg = vcfg.replace(img_size=cfg.res)
        model = VisionTransformer(vcfg)
        model.preprocess_cfg = PreprocessConfig(input_size=vcfg.img_size, crop_pct=data_recipe(cfg.data).crop_pct)
        return model
    init = load_checkpoint(cfg.init)
    # Rebuild so that dropout settings apply; the weights are carried over unchanged.
    model = VisionTransformer(init.cfg.replace(**regularisers, **cfg.model_args))
    model.load_state_dict(init.state_dict())
    model.preprocess_cfg, model.labels = init.preprocess_cfg, init.labels
    new_head = cfg.new_head if cfg.new_head is not None else list(init.labels or []) != list(classes)
    if new_head:
        model.reset_head(num_classes)  # paper §3.2: drop the head (and pre-logits), zero-initialised D x K
    if cfg.res:  # 2-D interpolation of the position embeddings, checkpoint's mode; RoPE tables follow the grid
        model.set_resolution(*cfg.res)
    if cfg.reinit_pos_embed:  # the control of the resolution-transfer experiment
        if model.pos_embed is None:
            raise OptionError(f"--reinit-pos-embed: {cfg.init} has no absolute position embeddings to reinitialise "
                              "(its positions are rotary: RoPE)")
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


@dataclass
class RunState:
    """Where a run stands: what the checkpoint stores (step, epoch, index, best) and the log's counters."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    index: int = 0  # micro-batches of `epoch` consumed
    best: float = -1.0  # best validation top-1 so far
    best_ema: float = -1.0  # the EMA weights' best validation top-1 so far
    skipped: int = 0  # unreadable training images skipped by this process
    images_since_log: int = 0  # across processes
    images_total: int = 0


class Trainer:
    """One training run of `cfg`: built by :meth:`setup`, driven by :meth:`run`, one :meth:`step` at a time.

    Every process builds its own Trainer; the loop state lives in `self.state` (a :class:`RunState`).
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.state = RunState()
        self.setup()

    # ---- setup ----

    def setup(self) -> None:
        """Processes, data, model, optimizer, the resumed state and the logs, in the order that fixes the RNG
        draws (the initial weights, then MPP's token, then a resumed run's saved state)."""
        self._start_process()
        self._build_model()
        self._build_loaders()
        self._build_optimizer()
        self._resume()
        self._wrap()
        self._open_logs()

    def _start_process(self) -> None:
        cfg = self.cfg
        self.rank, self.world = distributed.setup(device_type(cfg.device))  # first: XLA's rendezvous
        self.device = resolve_device(cfg.device)
        self.is_main = self.rank == 0
        self.out = Path(cfg.out)
        self.state_path = self.out / "checkpoints" / "last.pt"
        if self.state_path.exists() and not cfg.resume:  # every rank: none may wait on a rank that stopped
            raise TrainingError(f"{self.out} already holds a run; pass --resume to continue it or choose another "
                                "--out")
        random.seed(cfg.seed)  # the same on every rank: identical initial weights
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.micro, rem = divmod(cfg.batch_size, cfg.accum_steps * self.world)
        if rem or self.micro == 0:
            raise TrainingError(f"batch size {cfg.batch_size} does not split into {cfg.accum_steps} accumulation "
                                f"steps x {self.world} processes")

    def _build_model(self) -> None:
        cfg = self.cfg
        self.train_base = build_dataset(cfg.data, "train", _raw, strict=cfg.strict)
        self.num_classes = len(self.train_base.classes)
        model = build_model(cfg, list(self.train_base.classes))
        model.labels = list(self.train_base.classes) if cfg.objective == "classify" else None
        model.grad_checkpointing = cfg.grad_checkpointing
        if self.device.type == "xla" and xla.hardware(self.device) == "TPU":
            try:
                xla.use_pallas_attention(model)
            except ImportError as e:
                raise TrainingError(str(e)) from None
        self.model = model.to(self.device)
        self.pre = model.preprocess_cfg
        self.teacher = self._build_teacher()

    def _build_teacher(self) -> Teacher | None:
        """DeiT distillation: the frozen teacher, checked against the student (which must have a dist token)."""
        cfg, model = self.cfg, self.model
        if not cfg.teacher:
            return None
        if model.head_dist is None:
            raise OptionError(f"--teacher distils through the distillation token, and {cfg.init or cfg.model} has "
                              "none (a DeiT *_distilled checkpoint, or --model-args dist_token=true)")
        teacher = load_teacher(cfg.teacher, self.device)
        teacher.fit_student(self.num_classes, self.train_base.classes, model.cfg.img_size, self.pre.mean,
                            self.pre.std)
        model.distilled_training = True  # forward in train mode: (cls logits, dist logits)
        return teacher

    def _build_loaders(self) -> None:
        cfg, micro = self.cfg, self.micro
        augment = train_transform(self.pre, cfg.inception_crop, cfg.flip, cfg.randaugment, cfg.translate)
        self.train_ds = SeededTransform(self.train_base, augment, cfg.seed)
        val_ds = build_dataset(cfg.data, "test", eval_transform(self.pre), strict=cfg.strict)
        self.sampler = distributed.ResumableSampler(self.train_ds, self.world, self.rank, cfg.seed)
        self.pin = self.device.type == "cuda"
        # Own generators: a DataLoader otherwise draws its worker seed from the global RNG each time an epoch
        # starts, which would shift every later dropout mask of a resumed run.
        self.loader = DataLoader(self.train_ds, batch_size=micro, sampler=self.sampler, num_workers=cfg.workers,
                                 drop_last=True, collate_fn=collate_skip, pin_memory=self.pin,
                                 generator=torch.Generator().manual_seed(cfg.seed))
        self.val_loader = DataLoader(val_ds, batch_size=micro,
                                     sampler=distributed.ShardSampler(len(val_ds), self.world, self.rank),
                                     num_workers=cfg.workers, collate_fn=collate_skip, pin_memory=self.pin,
                                     generator=torch.Generator().manual_seed(cfg.seed))
        if len(self.sampler) < micro:
            raise TrainingError(f"the training set ({len(self.train_ds)} images) is smaller than one batch per "
                                "process")

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        mpp = cfg.objective == "mpp"
        self.net: torch.nn.Module = MPPModel(self.model, ratio=cfg.mpp_ratio).to(self.device) if mpp else self.model
        self.optimizer = build_optimizer(self.net, cfg, depth=self.model.cfg.depth)
        self.ema = ModelEMA(self.model, cfg.ema_decay) if cfg.ema_decay else None
        self.ema_res: EvalResult | None = None
        self.schedule = build_schedule(self.optimizer, cfg)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        if self.amp_dtype is not None and self.device.type != "cuda":
            raise TrainingError(f"--precision {cfg.precision} needs a CUDA device; use fp32 here")
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
        self.mix = MixupCutmix(self.num_classes, cfg.mixup, cfg.cutmix, cfg.label_smoothing) \
            if cfg.mixup or cfg.cutmix else None

    def _resume(self) -> None:
        """Continue from the saved state, if asked and there is one; check every process found the same."""
        cfg, s = self.cfg, self.state
        if cfg.resume and self.state_path.exists():
            st = load_state(self.state_path)
            self.net.load_state_dict(st["model"])
            self.optimizer.load_state_dict(st["optimizer"])
            self.schedule.load_state_dict(st["schedule"])
            self.scaler.load_state_dict(st["scaler"])
            s.step, s.epoch, s.index, s.best = st["step"], st["epoch"], st["index_in_epoch"], st["best"]
            if self.ema is not None:
                if "ema" not in st:
                    raise TrainingError(f"--ema-decay, but the run at {self.state_path} was started without it")
                self.ema.load_state_dict(st["ema"])
                s.best_ema = st.get("best_ema", -1.0)
            set_rng_state(st["rng"])
            if self.is_main:
                restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
                print(f"resuming at step {s.step} of {cfg.steps} from {self.state_path}"
                      + (f" (torchrun restart {restart})" if restart else ""), flush=True)
        # Every rank reads the state itself: ranks that found different ones (a node-local --out on several
        # machines) would run different numbers of steps into a deadlock. The sum over the ranks equals
        # world x own step on every rank only when all the steps are equal.
        step_sum = distributed.sum_across(torch.tensor(s.step, device=self.device)) if self.world > 1 else None
        if step_sum is not None and int(step_sum.item()) != self.world * s.step:
            raise TrainingError(f"the processes found different training states at {self.state_path} (this one: "
                                f"{'step ' + str(s.step) if s.step else 'none'}); with several machines --out must "
                                "be a folder every machine sees at the same path (shared storage)")

    def _wrap(self) -> None:
        """DDP across processes (on XLA, torch_xla all-reduces the gradients instead), then torch.compile."""
        self.trunk = self.net
        if self.world > 1 and self.device.type != "xla":
            self.trunk = torch.nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.device.index] if self.pin else None,
                find_unused_parameters=self.cfg.objective == "mpp")
        if self.cfg.compile:
            self.trunk = torch.compile(self.trunk)

    def _open_logs(self) -> None:
        cfg = self.cfg
        if self.is_main and (hazard := distributed.restart_hazard()):
            print(f"warning: {hazard}", file=sys.stderr, flush=True)
        self.log_file = MetricsLog(self.out, enabled=self.is_main)
        if self.is_main:
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        self.progress = Progress(cfg.steps, self.state.step, enabled=self.is_main and cfg.progress)
        self.batches = _batches(self.loader, self.sampler, self.train_ds, self.state.epoch,
                                self.state.index * self.micro)

    # ---- the loop ----

    def run(self) -> dict[str, Any]:
        """Train to `cfg.steps` (evaluating, logging and checkpointing on the way) and finish; the summary."""
        cfg, s = self.cfg, self.state
        if cfg.eval_at_start and cfg.objective == "classify" and s.step == 0:
            first = self.evaluate()
            if self.is_main:
                print(f"before training: top-1 {100 * first.top1:.2f}%", flush=True)
        self.t_start = self.t_log = time.perf_counter()
        while s.step < cfg.steps:
            loss_sum = self.step()
            if s.step % cfg.log_every == 0 or s.step == cfg.steps:
                self.log(loss_sum)
            if cfg.eval_every and s.step % cfg.eval_every == 0 and s.step < cfg.steps \
                    and cfg.objective == "classify":
                self.keep_if_best(self.evaluate())
            if cfg.ckpt_every and s.step % cfg.ckpt_every == 0:
                self.checkpoint()
        self.progress.close()
        return self.finish(time.perf_counter() - self.t_start)

    def step(self) -> torch.Tensor:
        """One optimizer step over `accum_steps` micro-batches; the mean loss (a device scalar)."""
        cfg, s = self.cfg, self.state
        seed_step(cfg.seed, self.rank, s.step, self.device)  # a resumed run draws what an uninterrupted one would
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for m in range(cfg.accum_steps):
            x, y = self._next_batch()
            last = m == cfg.accum_steps - 1
            sync = self.trunk.no_sync() if not last and hasattr(self.trunk, "no_sync") else contextlib.nullcontext()
            with sync, torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = self._loss(x, y)
                self.scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.detach() / cfg.accum_steps
            s.images_since_log += x.shape[0] * self.world
        if self.device.type != "xla":  # on XLA the check waits for a log step: no host sync per step
            loss_value = distributed.mean_across(loss_sum).item()
            if not math.isfinite(loss_value):
                raise TrainingError(f"loss is {loss_value} at step {s.step + 1}; stopping. The last good checkpoint "
                                    f"is intact: {self.state_path if self.state_path.exists() else 'none yet'}")
        self._apply_gradients()
        if self.ema is not None:
            self.ema.update(self.model)
        s.step += 1
        return loss_sum

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch on the device, skipping any whose every image was unreadable."""
        s = self.state
        x = None
        while x is None:
            s.epoch, s.index, x, y, skipped = next(self.batches)
            s.skipped += skipped
        return x.to(self.device, non_blocking=self.pin), y.to(self.device, non_blocking=self.pin)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The objective on one micro-batch x [B, 3, H, W], y [B]: MPP, mixed soft targets, or cross-entropy;
        with a teacher, DeiT's distillation loss around it (the teacher sees the mixed batch, as in DeiT)."""
        cfg = self.cfg
        if cfg.objective == "mpp":
            targets = mpp_targets(denormalize(x, self.pre.mean, self.pre.std), self.model.cfg.patch_size)
            return self.trunk(x, targets)
        if self.mix is not None:
            x, y_soft = self.mix(x, y)
            out = self.trunk(x)
            base = soft_target_cross_entropy(out[0] if self.teacher else out, y_soft)
        else:
            out = self.trunk(x)
            base = F.cross_entropy(out[0] if self.teacher else out, y, label_smoothing=cfg.label_smoothing)
        if self.teacher is None:
            return base
        return distillation_loss(base, out[1], self.teacher(x), cfg.distill, cfg.distill_alpha, cfg.distill_tau)

    def _apply_gradients(self) -> None:
        """Clip (after XLA's all-reduce, as DDP's precedes it), step the optimizer and the schedule."""
        if self.device.type == "xla":
            xla.reduce_gradients(self.optimizer)
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.cfg.grad_clip)
        if self.device.type == "xla":
            self.optimizer.step()
            xla.sync()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.schedule.step()

    def log(self, loss_sum: torch.Tensor) -> None:
        """A metrics record of the step just taken (loss, lr, throughput, skipped images) and the progress bar."""
        cfg, s = self.cfg, self.state
        loss_value = distributed.mean_across(loss_sum).item()
        if not math.isfinite(loss_value):
            raise TrainingError(f"loss is {loss_value} at step {s.step}; stopping")
        now = time.perf_counter()
        ips = s.images_since_log / max(now - self.t_log, 1e-9)
        s.images_total += s.images_since_log
        group = self.optimizer.param_groups[0]
        lr = group["lr"] / group.get("lr_scale", 1.0)  # the base lr (layer decay scales each group's)
        skipped_all = int(distributed.sum_across(torch.tensor(s.skipped, device=self.device)).item())
        self.log_file.write({"step": s.step, "epoch": s.epoch, "loss": loss_value, "lr": lr, "images_per_s": ips,
                             "skipped": skipped_all})
        self.progress.update(s.step, cfg.log_every if s.step % cfg.log_every == 0 else s.step % cfg.log_every,
                             loss=loss_value, lr=lr, img_s=ips)
        self.t_log, s.images_since_log = now, 0

    def evaluate(self) -> EvalResult:
        """Every rank scores its shard; the counts are summed, so every rank gets the whole set's result. With
        --ema-decay the EMA weights are scored too (`self.ema_res`, logged as val_*_ema)."""
        def score(model: torch.nn.Module) -> EvalResult:
            return evaluate(model, self.val_loader, device=self.device, amp_dtype=self.amp_dtype,
                            num_classes=self.num_classes, reduce=distributed.sum_across)

        res = score(self.model)
        record = {"step": self.state.step, "val_top1": res.top1, "val_top5": res.top5, "val_loss": res.loss}
        if self.ema is not None:
            self.ema_res = e = score(self.ema.module)
            record.update(val_top1_ema=e.top1, val_top5_ema=e.top5, val_loss_ema=e.loss)
        self.log_file.write(record)
        return res

    def keep_if_best(self, res: EvalResult) -> None:
        """A new best validation top-1: remember it and write best.safetensors (the EMA's: best_ema)."""
        if res.top1 > self.state.best:
            self.state.best = res.top1
            if self.is_main:
                vit_serve.save(self.model, self.out / "best.safetensors", overwrite=True)
        if self.ema_res is not None and self.ema_res.top1 > self.state.best_ema:
            self.state.best_ema = self.ema_res.top1
            if self.is_main:
                vit_serve.save(self.ema.module, self.out / "best_ema.safetensors", overwrite=True)

    def checkpoint(self) -> None:
        """The whole state, atomically, by the main process; every process waits for it."""
        s = self.state
        if self.is_main:
            ema = {"ema": self.ema.state_dict(), "best_ema": s.best_ema} if self.ema is not None else {}
            save_state(self.state_path, model=self.net.state_dict(), optimizer=self.optimizer.state_dict(),
                       schedule=self.schedule.state_dict(), scaler=self.scaler.state_dict(), step=s.step,
                       epoch=s.epoch, index_in_epoch=s.index, best=s.best, config=self.cfg.to_dict(), **ema)
        distributed.barrier()

    # ---- the end ----

    def finish(self, wall: float) -> dict[str, Any]:
        """The last checkpoint and evaluation, the run's files, the summary table; the summary."""
        cfg, s = self.cfg, self.state
        self.checkpoint()
        summary: dict[str, Any] = {"steps": s.step, "wall_s": wall, "images_per_s": s.images_total / max(wall, 1e-9),
                                   "skipped": s.skipped, "world_size": self.world}
        res = None
        if cfg.objective == "classify":
            res = self.evaluate()
            summary.update(top1=res.top1, top5=res.top5, val_loss=res.loss, val_images=res.n)
            if self.ema_res is not None:
                summary.update(top1_ema=self.ema_res.top1, top5_ema=self.ema_res.top5, val_loss_ema=self.ema_res.loss)
        if self.is_main:
            self._write_outputs(summary, res)
            print(summary_table(self._summary_rows(summary, wall)), flush=True)
        self.log_file.close()
        distributed.teardown()
        return summary

    def _write_outputs(self, summary: dict[str, Any], res: EvalResult | None) -> None:
        """best/model.safetensors, confusion.png, curves.png and summary.json (main process only); adds
        few_shot to `summary` when asked for."""
        cfg, out = self.cfg, self.out
        if res is not None and cfg.reference:
            self._attach_references()
        if res is not None:
            if res.top1 > self.state.best:
                vit_serve.save(self.model, out / "best.safetensors", overwrite=True)
            save_confusion_png(res.confusion, self.model.labels or [], out / "confusion.png",
                               f"validation, step {self.state.step}: top-1 {100 * res.top1:.2f}%")
        if cfg.few_shot:
            summary["few_shot"] = few_shot_on(self.model, cfg.data, cfg.few_shot, cfg.seed, self.device)
        vit_serve.save(self.model, out / "model.safetensors", overwrite=True,
                       extra_metadata={"train_config": cfg.to_dict(), "summary": summary})
        if self.ema is not None:  # the EMA weights beside the raw ones
            if self.ema_res is not None and self.ema_res.top1 > self.state.best_ema:
                vit_serve.save(self.ema.module, out / "best_ema.safetensors", overwrite=True)
            vit_serve.save(self.ema.module, out / "model_ema.safetensors", overwrite=True,
                           extra_metadata={"train_config": cfg.to_dict(), "summary": summary,
                                           "ema_decay": cfg.ema_decay})
        plot_curves(read_metrics(self.log_file.path), out / "curves.png", f"{cfg.mode} on {cfg.data}")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))

    def _attach_references(self) -> None:
        """Each saved model's reference (`vit_serve.reference`): fitted on a sample of the training set, seen as
        at evaluation (no augmentation), calibrated on the validation split."""
        from vit_serve.reference import reference_from_datasets

        fit = build_dataset(self.cfg.data, "train", eval_transform(self.pre), strict=self.cfg.strict)
        calibration = self.val_loader.dataset
        for model in (self.model, *([self.ema.module] if self.ema is not None else [])):
            model.reference = reference_from_datasets(model, fit, calibration, f"{self.cfg.data}: train / val",
                                                      seed=self.cfg.seed)

    def _summary_rows(self, summary: dict[str, Any], wall: float) -> dict[str, str]:
        rows = {"top-1": f"{100 * summary['top1']:.2f}%", "top-5": f"{100 * summary['top5']:.2f}%"} \
            if "top1" in summary else {}
        if "top1_ema" in summary:
            rows["top-1 (EMA)"] = f"{100 * summary['top1_ema']:.2f}%"
        rows.update({"images/s": f"{summary['images_per_s']:.1f}", "wall time": f"{wall:.1f} s",
                     "steps": str(self.state.step), "skipped images": str(self.state.skipped),
                     "model": str(self.out / "model.safetensors")})
        return rows


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training `cfg` describes on this process (one of a torchrun job, or alone).

    Writes into `cfg.out`: config.json, metrics.jsonl (and TensorBoard), checkpoints/last.pt (every `ckpt_every`
    steps and at the end), best.safetensors, model.safetensors, confusion.png, curves.png, summary.json; with
    --ema-decay also model_ema.safetensors and best_ema.safetensors (the EMA weights; last.pt holds them too).
    Returns the summary: steps, wall_s, images_per_s, skipped, world_size (and for classification top1, top5,
    val_loss, val_images; few_shot when asked for).
    """
    return Trainer(cfg).run()
