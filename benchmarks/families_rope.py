"""The RoPE families' part of benchmarks/families.py: what rotary embeddings and SwiGLU cost beside a plain ViT.

Per family (timm's `Eva`: DINOv3-S/16, PE-Core-T/16 at 384, EVA02-Ti/14, RoPE-ViT-B/16 mixed) at its native size
(timm's pretrained input size), batch 1 and 8, CPU fp32: images/s of our model (converted from timm's state dict,
random weights, seeded) eager (`torch.inference_mode`) and in onnxruntime (the `--res dynamic` export, the graph
that runs at any size), beside a plain ViT of the same width, depth, heads, patch and size (ours: learned absolute
position embeddings, GELU MLP 4x wide, class token), exported the same way; and each export's node count. Checks:
our eager logits equal timm's, and onnxruntime's equal our eager ones, within 1e-4; no speed target (the numbers
show the cost). timm's CPU tables have EVA02-B at 0.66x ViT-B/16.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vit_serve.config import ViTConfig
from vit_serve.model import VisionTransformer

PARITY_TOL = 1e-4
BATCHES = (1, 8)


@dataclass(frozen=True)
class RopeFamily:
    """One RoPE family: timm's name, its native size, timm.create_model overrides, and what --tiny adds to them."""

    key: str
    timm_name: str
    res: int
    overrides: dict[str, Any]
    tiny_extra: dict[str, Any]


ROPE_FAMILIES: tuple[RopeFamily, ...] = (
    # DINOv3 embeds with its class token (as upstream and our import); timm's default pools the patch average
    RopeFamily("dinov3_s16", "vit_small_patch16_dinov3", 256, {"global_pool": "token"}, {}),
    RopeFamily("pe_core_t16", "vit_pe_core_tiny_patch16_384", 384, {}, {"ref_feat_shape": (2, 2)}),
    RopeFamily("eva02_ti14", "eva02_tiny_patch14_224", 224, {}, {}),
    RopeFamily("rope_mixed_b16", "vit_base_patch16_rope_mixed_224", 224, {}, {}),
)
_HUB_ARGS = ("num_heads", "img_size", "global_pool", "ref_feat_shape")


def rope_pair(fam: RopeFamily, tiny: dict[str, Any] | None = None) -> tuple[torch.nn.Module, VisionTransformer, int]:
    """(timm's model, ours converted from its state dict, the size): random weights (seed 0), eval mode;
    `tiny`: timm.create_model overrides for a smoke run, at 2 x 2 patches."""
    import timm

    from vit_serve.checkpoints import build_model
    from vit_serve.checkpoints.timm_state import convert_timm

    patch = 14 if "patch14" in fam.timm_name else 16
    res = 2 * patch if tiny else fam.res
    kw = {**fam.overrides, **(tiny or {}), **(fam.tiny_extra if tiny else {}), "img_size": res}
    torch.manual_seed(0)
    ref = timm.create_model(fam.timm_name, pretrained=False, **kw).eval()
    if isinstance(ref.head, torch.nn.Linear):  # timm zero-initialises it: zero logits would agree whatever the network
        with torch.no_grad():
            ref.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    hub = {"architecture": fam.timm_name, "model_args": {k: v for k, v in kw.items() if k in _HUB_ARGS}}
    ours = build_model(convert_timm(ref.state_dict(), fam.timm_name, hub_config=hub)).eval()
    return ref, ours, res


def plain_like(model: VisionTransformer) -> VisionTransformer:
    """A plain ViT of `model`'s width, depth, heads, patch, size and classes (seed 0): absolute position
    embeddings, GELU MLP 4x wide, class token, no RoPE."""
    c = model.cfg
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=tuple(c.img_size), patch_size=c.patch_size, embed_dim=c.embed_dim, depth=c.depth,
                    num_heads=c.num_heads, mlp_dim=4 * c.embed_dim, num_classes=c.num_classes)
    return VisionTransformer(cfg).eval()


@dataclass(frozen=True)
class RopeRow:
    family: str
    timm_name: str
    res: int
    batch: int
    eager: float
    plain_eager: float
    ort: float
    plain_ort: float
    ops: int
    plain_ops: int
    timm_diff: float
    ort_diff: float


def _session(path: Path, threads: int) -> Callable[[torch.Tensor], Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"pixel_values": x.numpy()})[0]


def _export(model: VisionTransformer, path: Path) -> int:
    """The --res dynamic export of `model` at `path`; its node count."""
    import onnx
    from vit_export.graph_ops import graph_ops
    from vit_export.onnx_export import export_graph

    export_graph(model, path, res="dynamic", simplify=False)
    return graph_ops(onnx.load(str(path))).count


def measure_rope(fam: RopeFamily, batches: tuple[int, ...], rounds: int, iters: int,
                 time_nets: Callable[..., dict[str, list[float]]], tiny: dict[str, Any] | None = None) -> list[RopeRow]:
    """One family: both models exported once, then per batch the four rates (median round; the four take turns
    in each round, `time_nets` being families.py's `time_pair`) and the parities."""
    ref, ours, res = rope_pair(fam, tiny)
    plain = plain_like(ours)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="families-rope-") as tmp:
        ops, plain_ops = _export(ours, Path(tmp) / "rope.onnx"), _export(plain, Path(tmp) / "plain.onnx")
        run, run_plain = _session(Path(tmp) / "rope.onnx", threads), _session(Path(tmp) / "plain.onnx", threads)
        rows = []
        for b in batches:
            x = torch.randn(b, 3, res, res, generator=torch.Generator().manual_seed(b))
            with torch.inference_mode():
                eager = ours(x)
                timm_diff = float((eager - ref(x)).abs().max())
            ort_diff = float((torch.from_numpy(run(x)) - eager).abs().max())
            nets = {"eager": ours, "plain_eager": plain, "ort": run, "plain_ort": run_plain}
            med = {k: statistics.median(v) for k, v in time_nets(nets, x, rounds, iters).items()}
            rows.append(RopeRow(fam.key, fam.timm_name, res, b, b / med["eager"], b / med["plain_eager"],
                                b / med["ort"], b / med["plain_ort"], ops, plain_ops, timm_diff, ort_diff))
    return rows


def rope_plan(only: list[str] | None) -> list[RopeFamily]:
    return [f for f in ROPE_FAMILIES if not only or f.key in only]


def rope_table(rows: list[RopeRow]) -> list[dict[str, Any]]:
    """The table's rows (results_file.Table.from_dicts): rates, the ratios to the plain ViT, node counts."""
    return [{"family": r.family, "timm model": r.timm_name, "res": r.res, "batch": r.batch,
             "eager img/s": round(r.eager, 3), "plain ViT eager img/s": round(r.plain_eager, 3),
             "eager / plain": round(r.eager / r.plain_eager, 3), "onnxruntime img/s": round(r.ort, 3),
             "plain ViT onnxruntime img/s": round(r.plain_ort, 3), "onnxruntime / plain": round(r.ort / r.plain_ort, 3),
             "graph nodes": r.ops, "plain graph nodes": r.plain_ops, "max abs diff vs timm": r.timm_diff}
            for r in rows]


def rope_checks(rows: list[RopeRow]) -> list[tuple[str, str, str, bool]]:
    """Parity checks (timm vs our eager, onnxruntime vs our eager), one pair per family and batch."""
    out = []
    for r in rows:
        out.append((f"{r.family} b{r.batch}: |Δ logit| ours vs timm", f"{r.timm_diff:.1e}", f"<= {PARITY_TOL:g}",
                    r.timm_diff <= PARITY_TOL))
        out.append((f"{r.family} b{r.batch}: |Δ logit| onnxruntime vs ours", f"{r.ort_diff:.1e}",
                    f"<= {PARITY_TOL:g}", r.ort_diff <= PARITY_TOL))
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (columns in order)."""
    cols = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(f"{v:.1e}" if isinstance(v, float) and c.startswith("max") else str(v)
                                for c, v in r.items()) + " |" for r in rows]
    return "\n".join(lines)
