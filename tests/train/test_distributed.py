"""vit_serve.train.distributed and the loop under torchrun (2 gloo processes on the CPU): every rank draws its
own dropout / drop-path / Mixup randomness, resumes it exactly, and scores its own share of the validation
set, whose summed result equals a single-process evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vit_serve
from vit_serve.data import build_dataset, collate_skip
from vit_serve.train.augment import eval_transform
from vit_serve.train.distributed import ShardSampler
from vit_serve.train.evaluate import evaluate
from vit_serve.train.progress import read_metrics
from vit_serve.train.seeded import step_seed

PROBE = Path(__file__).with_name("ddp_probe.py")
ARGS = ["--steps", "6", "--batch-size", "16", "--log-every", "1", "--ckpt-every", "3", "--eval-every", "3",
        "--lr", "0.003", "--dropout", "0.1", "--drop-path", "0.6", "--mixup", "0.8", "--cutmix", "1.0",
        "--model-args", "depth=2,embed_dim=32,num_heads=2,mlp_dim=64,patch_size=2", "--res", "8", "--no-progress"]


def probe(record: Path, out: Path, *train_args: str, exit_after: int | None = None) -> None:
    record.mkdir(parents=True, exist_ok=True)
    stop = [] if exit_after is None else ["--exit-after-step", str(exit_after)]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(PROBE), str(record), *stop, "train", "--out", str(out), *ARGS, *train_args],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


def ranks(record: Path) -> list[dict]:
    return [json.loads((record / f"rank{r}.json").read_text()) for r in (0, 1)]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ddp")
    probe(root / "record", root / "run")
    return root / "run", ranks(root / "record")


def test_step_seeds_differ_by_rank_and_step():
    seeds = {step_seed(0, rank, step) for rank in range(8) for step in range(1000)}
    assert len(seeds) == 8000 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(0, 1, 5) == step_seed(0, 1, 5) != step_seed(1, 1, 5)


def test_shard_sampler_covers_every_index_once():
    shards = [list(ShardSampler(10, 3, r)) for r in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [len(ShardSampler(10, 3, r)) for r in range(3)] == [4, 3, 3]
    assert list(ShardSampler(1, 2, 1)) == []


def test_ranks_draw_their_own_dropout_drop_path_and_mixup(reference):
    _, (r0, r1) = reference
    assert sorted(r0["steps"], key=int) == [str(s) for s in range(6)] == sorted(r1["steps"], key=int)
    for step in r0["steps"]:
        a, b = r0["steps"][step], r1["steps"][step]
        kinds = {d[0] for d in a}
        assert kinds == {"dropout", "drop_path", "mix"} and len(a) == len(b)
        for kind in kinds:  # every kind of draw differs between the ranks at every step
            assert [d for d in a if d[0] == kind] != [d for d in b if d[0] == kind], (step, kind)
        # ... and within a rank from one step to the next
        assert a != r0["steps"][str((int(step) + 1) % 6)]


def test_resume_is_exact_on_every_rank(reference, tmp_path):
    ref_out, ref_ranks = reference
    out = tmp_path / "run"
    probe(tmp_path / "first", out, exit_after=3)  # every rank ends hard after the step-3 checkpoint
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"] == 3
    assert not (out / "model.safetensors").exists()
    probe(tmp_path / "resumed", out, "--resume")
    resumed = ranks(tmp_path / "resumed")
    for rank in (0, 1):
        assert sorted(resumed[rank]["steps"], key=int) == ["3", "4", "5"]
        for step in ("3", "4", "5"):
            assert resumed[rank]["steps"][step] == ref_ranks[rank]["steps"][step], (rank, step)
    want, got = losses(ref_out), losses(out)
    assert sorted(got) == list(range(1, 7)) and got == want


def test_evaluation_is_sharded_and_equals_one_process(reference):
    out, (r0, r1) = reference
    val = build_dataset("digits", "test", eval_transform(vit_serve.load(out / "model.safetensors").preprocess_cfg))
    n = len(val)
    # Two evaluations (step 3, end); each rank scored its half, never the whole set.
    assert r0["eval_images"] + r1["eval_images"] == 2 * n
    assert abs(r0["eval_images"] - r1["eval_images"]) <= 2
    summary = json.loads((out / "summary.json").read_text())
    model = vit_serve.load(out / "model.safetensors")
    loader = torch.utils.data.DataLoader(val, batch_size=64, collate_fn=collate_skip)
    single = evaluate(model, loader)
    print(f"sharded (2 ranks): top-1 {summary['top1']:.6f} top-5 {summary['top5']:.6f} loss {summary['val_loss']:.9f}"
          f"\none process:       top-1 {single['top1']:.6f} top-5 {single['top5']:.6f} loss {single['loss']:.9f}")
    assert summary["val_images"] == single["n"] == n
    assert summary["top1"] == single["top1"] and summary["top5"] == single["top5"]
    assert summary["val_loss"] == pytest.approx(single["loss"], rel=1e-6)


def test_sharded_evaluate_sums_counts_and_confusion():
    """evaluate(reduce=...) over shards, the reduction a plain sum of the shards' packed counts."""

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return x.flatten(1)[:, :4]

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(23, 1, 2, 2, generator=g), torch.randint(0, 4, (23,), generator=g)
    whole = evaluate(Fixed(), [(x, y)])
    parts: list[list[torch.Tensor]] = [[], []]

    def run(shard: int, reduce) -> dict:
        idx = list(ShardSampler(23, 2, shard))
        return evaluate(Fixed(), [(x[idx], y[idx])], num_classes=4, reduce=reduce)

    for shard in (0, 1):  # first pass: collect each shard's tensors
        run(shard, lambda t, s=shard: parts[s].append(t.clone()) or t)
    sums = [parts[0][i] + parts[1][i] for i in range(2)]
    calls = iter(sums)
    res = run(0, lambda t: next(calls))
    assert res["n"] == 23 and res["top1"] == whole["top1"] and res["top5"] == whole["top5"]
    assert torch.equal(res["confusion"], whole["confusion"]) and res["loss"] == pytest.approx(whole["loss"])
    empty = evaluate(Fixed(), [], num_classes=4, reduce=lambda t: t)
    assert empty["n"] == 0 and empty["confusion"].shape == (4, 4)
    with pytest.raises(ValueError, match="num_classes"):
        evaluate(Fixed(), [], reduce=lambda t: t)
