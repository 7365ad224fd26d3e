"""Forward throughput of each deployed ViT family: timm's own model against ours with the same weights, one run.

For each family (DeiT distilled, DINOv2, DINOv2 with registers, CLIP, SigLIP) at its real size, timm's model
(`timm.create_model(name, pretrained=False)`, seeded) and a `vit_serve.model.VisionTransformer` built from a
`ViTConfig` with the family's options (`FAMILIES`), loaded with timm's state dict (strict: the same parameter
names). CPU, fp32, eager, `torch.inference_mode`; 2 warm-up rounds, then `--rounds` timed rounds of `--iters`
forwards each, timm and ours taking turns so that machine noise hits both alike; images/s from the median round.
Target (issue 21): ours >= 0.97x timm for every family. max |diff| is the largest logit (or, for the headless
DINOv2 / SigLIP towers, pooled-feature) difference on the benchmark batch: a sanity column, 0 expected.

    python benchmarks/families.py                          # every family at 224, DINOv2 also at 518 (~15 min, 2 cores)
    python benchmarks/families.py --only dinov2 --res 518  # one family at one resolution
    python benchmarks/families.py --tiny --rounds 1 --iters 1   # a smoke run (seconds): tiny widths, same code
    python benchmarks/families.py --part rope              # the RoPE families only (benchmarks/families_rope.py)

A second table (benchmarks/families_rope.py; `--part rope`, part of the default run) sets each RoPE family
(DINOv3-S/16, PE-Core-T/16 at 384, EVA02-Ti/14, RoPE-ViT-B/16 mixed) at its native size, batch 1 and 8, eager
and in onnxruntime (its `--res dynamic` export) beside a plain ViT of the same width, with each export's node
count: the cost of RoPE and SwiGLU.

Exit status: 0 when every ratio meets the target, 1 when one does not (the table is printed either way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, a sibling, also when loaded by path
from families_rope import BATCHES, markdown, measure_rope, rope_checks, rope_plan, rope_table
from results_file import ResultsFile, Table, print_checks

from vit_serve.config import ViTConfig
from vit_serve.model import VisionTransformer

TARGET = 0.97


@dataclass(frozen=True)
class Family:
    """One row: timm's architecture name, the resolutions it is timed at, and our ViTConfig options for it."""

    key: str
    timm_name: str
    resolutions: tuple[int, ...]
    options: dict[str, Any]


# The family options of ViTConfig (vit_serve/config.py) that reproduce each timm architecture.
FAMILIES: tuple[Family, ...] = (
    Family("deit", "deit_small_distilled_patch16_224", (224,), dict(dist_token=True, family="deit")),
    Family("dinov2", "vit_small_patch14_dinov2", (224, 518), dict(init_values=1e-5, family="dinov2")),
    Family("dinov2_reg4", "vit_small_patch14_reg4_dinov2", (224,),
           dict(init_values=1e-5, reg_tokens=4, no_embed_class=True, family="dinov2")),
    Family("clip", "vit_base_patch16_clip_224", (224,),
           dict(norm_pre=True, patch_bias=False, layer_norm_eps=1e-5, family="clip")),
    Family("siglip", "vit_base_patch16_siglip_224", (224,),
           dict(class_token=False, pool="map", no_embed_class=True, family="siglip")),
)
# --tiny: the same architectures at smoke-test widths (timm accepts these keyword arguments).
TINY = dict(embed_dim=32, depth=2, num_heads=2)


def config_for(ref: torch.nn.Module, options: dict[str, Any]) -> ViTConfig:
    """Our ViTConfig for a timm VisionTransformer: its sizes read off the module, the family's options given."""
    attn, fc1 = ref.blocks[0].attn, ref.blocks[0].mlp.fc1
    return ViTConfig(img_size=tuple(ref.patch_embed.img_size), patch_size=ref.patch_embed.patch_size[0],
                     embed_dim=ref.embed_dim, depth=len(ref.blocks), num_heads=attn.num_heads,
                     mlp_dim=fc1.out_features, num_classes=ref.num_classes, **options)


def build_pair(fam: Family, res: int, tiny: bool = False) -> tuple[torch.nn.Module, VisionTransformer]:
    """timm's model (seed 0, random weights) and ours with its state dict loaded strictly; both in eval mode."""
    import timm

    torch.manual_seed(0)
    kw = {**TINY, "img_size": res} if tiny else {"img_size": res}
    ref = timm.create_model(fam.timm_name, pretrained=False, **kw).eval()
    ours = VisionTransformer(config_for(ref, fam.options))
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours.eval()


def time_pair(nets: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, rounds: int, iters: int,
              warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per forward of each net, one entry per round; the nets take turns within every round."""
    times: dict[str, list[float]] = {k: [] for k in nets}
    with torch.inference_mode():
        for _ in range(warmup):
            for net in nets.values():
                net(x)
        for _ in range(rounds):
            for k, net in nets.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    net(x)
                times[k].append((time.perf_counter() - t0) / iters)
    return times


@dataclass(frozen=True)
class Row:
    family: str
    timm_name: str
    res: int
    timm_ips: float
    ours_ips: float
    max_diff: float

    @property
    def ratio(self) -> float:
        return self.ours_ips / self.timm_ips


def measure(fam: Family, res: int, batch: int, rounds: int, iters: int, tiny: bool = False) -> Row:
    """One family at one resolution: both models' images/s (median round) and their max |diff| on the batch."""
    ref, ours = build_pair(fam, res, tiny)
    torch.manual_seed(1)
    x = torch.randn(batch, 3, res, res)
    with torch.inference_mode():
        diff = float((ours(x) - ref(x)).abs().max())
    times = time_pair({"timm": ref, "ours": ours}, x, rounds, iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    return Row(fam.key, fam.timm_name, res, batch / med["timm"], batch / med["ours"], diff)


def table(rows: list[Row]) -> str:
    """The markdown table: one line per (family, resolution)."""
    lines = ["| family | timm model | res | timm img/s | ours img/s | ours / timm | max abs diff |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.family} | {r.timm_name} | {r.res} | {r.timm_ips:.2f} | {r.ours_ips:.2f} | "
                     f"{r.ratio:.3f}x{'' if r.ratio >= TARGET else ' (below)'} | {r.max_diff:.1e} |")
    return "\n".join(lines)


def plan(only: list[str] | None, res: int | None, tiny: bool) -> list[tuple[Family, int]]:
    """(family, resolution) pairs to run: the families asked for, at `res` or their own resolutions."""
    fams = [f for f in FAMILIES if not only or f.key in only]
    if only and len(fams) + len(rope_plan(only)) != len(set(only)):
        raise SystemExit(f"--only: unknown family; expected some of {', '.join(all_keys())}")
    out = []
    for f in fams:
        patch = 14 if "patch14" in f.timm_name else 16
        sizes = (res,) if res else f.resolutions
        out += [(f, 2 * patch if tiny else s) for s in (sizes[:1] if tiny else sizes)]
    return out


def all_keys() -> list[str]:
    from families_rope import ROPE_FAMILIES

    return [f.key for f in (*FAMILIES, *ROPE_FAMILIES)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", metavar="FAMILY", help=f"some of {', '.join(all_keys())}")
    p.add_argument("--part", choices=("all", "timm", "rope"), default="all",
                   help="timm: ours against timm (the first table); rope: the RoPE families against a plain ViT")
    p.add_argument("--rope-batch", type=int, nargs="+", default=list(BATCHES), metavar="B",
                   help=f"the RoPE table's batches (default {' '.join(map(str, BATCHES))})")
    p.add_argument("--res", type=int, help="one resolution for every family (default: each family's own)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny widths, 2 x 2 patch grids")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    pairs = plan(args.only, args.res, args.tiny) if args.part != "rope" else []
    if args.only and args.part == "all" and not pairs:
        args.part = "rope"
    for fam, res in pairs:
        rows.append(measure(fam, res, args.batch, args.rounds, args.iters, args.tiny))
        r = rows[-1]
        print(f"{r.family} at {res}: timm {r.timm_ips:.2f}, ours {r.ours_ips:.2f} img/s ({r.ratio:.3f}x)",
              file=sys.stderr)
    rope_rows = []
    for rf in rope_plan(args.only) if args.part != "timm" else []:
        rope_rows += measure_rope(rf, tuple(args.rope_batch), args.rounds, args.iters, time_pair,
                                  TINY if args.tiny else None)
        print(f"{rf.key}: " + ", ".join(f"b{r.batch} eager {r.eager:.2f} (plain {r.plain_eager:.2f}), onnxruntime "
                                        f"{r.ort:.2f} (plain {r.plain_ort:.2f}) img/s" for r in rope_rows[-len(
                                            args.rope_batch):]), file=sys.stderr)
    import timm

    title = (f"Forward, batch {args.batch}, fp32, eager, inference_mode, CPU x{torch.get_num_threads()} threads, "
             f"torch {torch.__version__}, timm {timm.__version__}; median of {args.rounds} rounds x {args.iters} "
             f"forwards, timm and ours taking turns")
    tables = []
    if rows:
        print(f"\n{title}\n")
        print(table(rows))
        data = [{"family": r.family, "timm model": r.timm_name, "res": r.res, "timm img/s": round(r.timm_ips, 3),
                 "ours img/s": round(r.ours_ips, 3), "ours / timm": round(r.ratio, 3), "max abs diff": r.max_diff}
                for r in rows]
        tables.append(Table.from_dicts(title, data))
    checks = [(f"{r.family} at {r.res}: ours / timm images/s", f"{r.ratio:.3f}", f">= {TARGET}", r.ratio >= TARGET)
              for r in rows]
    if rope_rows:
        rope_title = (f"RoPE families beside a plain ViT of the same width: fp32, CPU x{torch.get_num_threads()} "
                      f"threads, eager (inference_mode) and onnxruntime (the --res dynamic export); median of "
                      f"{args.rounds} rounds x {args.iters} forwards, the four taking turns")
        data = rope_table(rope_rows)
        print(f"\n{rope_title}\n")
        print(markdown(data))
        tables.append(Table.from_dicts(rope_title, data))
        checks += rope_checks(rope_rows)
    print_checks(checks)
    return ResultsFile.of("families", tables, checks, {}, args, argv).save()


if __name__ == "__main__":
    sys.exit(main())
