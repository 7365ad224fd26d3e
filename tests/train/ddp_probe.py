"""`vit-serve train` under torchrun, recording what each rank draws and evaluates (run by test_distributed.py).

    torchrun --standalone --nproc-per-node 2 ddp_probe.py RECORD_DIR [--exit-after-step S] train ARGS...

The real functions run; thin wrappers only record: per optimizer step, a digest of every dropout and
drop-path mask and each Mixup / CutMix draw; per rank, the number of images scored in evaluation mode.
RECORD_DIR/rank<R>.json gets the record. --exit-after-step S ends every rank hard (os._exit) right after
the checkpoint of step S is written, as a kill would.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import vit_serve.model
import vit_serve.train.augment
import vit_serve.train.distributed
import vit_serve.train.loop
from vit_serve.cli import main

record: dict = {"steps": {}, "eval_images": 0}
current: list = []


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1((t == 0).cpu().numpy().tobytes()).hexdigest()[:16]


def _dump() -> None:
    path = Path(RECORD_DIR) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(record))


_seed_step = vit_serve.train.loop.seed_step


def seed_step(seed, rank, step, device):
    global current
    current = record["steps"].setdefault(str(step), [])
    return _seed_step(seed, rank, step, device)


_dropout = F.dropout


def dropout(input, p=0.5, training=True, inplace=False):
    out = _dropout(input, p, training, inplace)
    if training and p > 0:
        current.append(["dropout", _digest(out)])
    return out


_drop_path = vit_serve.model.drop_path


def drop_path(x, p, training):
    out = _drop_path(x, p, training)
    if training and p > 0:
        current.append(["drop_path", _digest(out.flatten(1).sum(1))])
    return out


_sample = vit_serve.train.augment.MixupCutmix.sample


def sample(self, height, width):
    params = _sample(self, height, width)
    current.append(["mix", params.lam, params.box])
    return params


_forward = vit_serve.model.VisionTransformer.forward


def forward(self, x, *args, **kwargs):
    if not self.training:
        record["eval_images"] += x.shape[0]
    return _forward(self, x, *args, **kwargs)


_barrier = vit_serve.train.distributed.barrier


def barrier():
    _barrier()
    state = Path(OUT) / "checkpoints" / "last.pt"
    if EXIT_AFTER is not None and state.exists() and torch.load(state, weights_only=True)["step"] >= EXIT_AFTER:
        _dump()
        os._exit(0)


if __name__ == "__main__":
    args = sys.argv[1:]
    RECORD_DIR, args = args[0], args[1:]
    EXIT_AFTER = None
    if args[0] == "--exit-after-step":
        EXIT_AFTER, args = int(args[1]), args[2:]
    OUT = args[args.index("--out") + 1]
    vit_serve.train.loop.seed_step = seed_step
    F.dropout = dropout
    vit_serve.model.drop_path = drop_path
    vit_serve.train.augment.MixupCutmix.sample = sample
    vit_serve.model.VisionTransformer.forward = forward
    vit_serve.train.distributed.barrier = barrier
    code = main(args)
    _dump()
    sys.exit(code)
