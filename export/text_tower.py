"""`vit-export --text-tower`: a checkpoint's text tower as `NAME_text.onnx`, its tokenizer files and its manifest.

    NAME_text.onnx          input_ids int64 [B, L] -> text_embeds float32 [B, E] (dynamic batch; L the context
                            length), the torch tower's `forward` (`vit_serve.text.tower.TextTransformer`)
    NAME_text.json          `vit_serve.text.manifest.TextTowerManifest` (tokenizer, logit_scale / logit_bias,
                            scores, templates: those of the checkpoint's zero-shot head, embedding dim, parity)
    NAME_text_tokenizer/    open_clip's BPE vocabulary, or the Hugging Face tokenizer.json

Parity: onnxruntime's embeddings of prompts (short, long and truncated) against the torch tower's, max |Δ| <= tol.
The tower is read from our checkpoint (`vit_serve.text.bundle`); one without it is refused (`NoTextTowerError`)
before anything is written.
"""

from __future__ import annotations

import io
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from vit_serve.text.manifest import (
    DEFAULT_TEMPLATES,
    INPUT_IDS,
    TEXT_EMBEDS,
    TOKENIZER_SUFFIX,
    TextTowerManifest,
    TokenizerSpec,
    text_manifest_path,
)

PARITY_TEXTS = ("a photo of a cat.", "a photo of a dog.", "", "an origami crane, folded from red paper, on a desk",
                " ".join(["very long prompt"] * 40))  # the last one is truncated to the context length


class NoTextTowerError(ValueError):
    """The checkpoint holds no text tower (the CLI exits 2: a usage error, nothing written)."""


@dataclass(frozen=True)
class WrittenTextTower:
    """The text graph written: its file, manifest, tokenizer folder and the parity check (max |Δ|, ok)."""

    path: Path
    manifest: Path
    tokenizer_dir: Path
    max_abs_err: float
    tol: float
    record: TextTowerManifest

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tol


def load_text_bundle(checkpoint: Path | None):
    """The checkpoint's `TextBundle`; NoTextTowerError when there is none (or no checkpoint file)."""
    from vit_serve.checkpoints.io import read_weights
    from vit_serve.text.bundle import bundle_from_checkpoint

    if checkpoint is None:
        raise NoTextTowerError("--text-tower needs a checkpoint file with a text tower (vit-serve convert of a "
                               "CLIP / SigLIP checkpoint keeps it), not a model object")
    tensors, meta = read_weights(checkpoint)
    bundle = bundle_from_checkpoint(tensors, meta, str(checkpoint))
    if bundle is None:
        raise NoTextTowerError(f"{checkpoint} has no text tower (convert a CLIP / SigLIP checkpoint with its text "
                               f"tower: vit-serve convert SRC DST --arch open_clip:NAME)")
    return bundle


def text_targets(out: Path, name: str) -> tuple[Path, Path, Path]:
    """NAME_text.onnx, NAME_text.json, NAME_text_tokenizer/ in `out`."""
    onnx_path = out / f"{name}_text.onnx"
    return onnx_path, text_manifest_path(onnx_path), out / f"{name}{TOKENIZER_SUFFIX}"


class _TextGraph(nn.Module):
    """input_ids [B, L] -> text_embeds [B, E] (float32)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.tower = tower

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tower(input_ids).float()


def _export_proto(tower: nn.Module, ids: torch.Tensor, opset: int):
    """The dynamo exporter (dynamic batch), the TorchScript one as a fallback: (proto, exporter)."""
    import onnx
    from torch.export import Dim

    graph = _TextGraph(tower).eval()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(graph, (ids,), dynamo=True, opset_version=opset, input_names=[INPUT_IDS],
                                     output_names=[TEXT_EMBEDS], verbose=False,
                                     dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=4096)}})
        return prog.model_proto, "dynamo"
    except Exception as e:  # the dynamo exporter raises many types
        why = " ".join(str(e).split())[:300]
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(graph, (ids,), buf, dynamo=False, opset_version=opset, input_names=[INPUT_IDS],
                          output_names=[TEXT_EMBEDS], dynamic_axes={INPUT_IDS: {0: "batch"}, TEXT_EMBEDS: {0: "batch"}})
    return onnx.load_from_string(buf.getvalue()), f"torchscript (dynamo failed: {why})"


def text_parity(bundle, onnx_path: Path, texts: tuple[str, ...] = PARITY_TEXTS) -> float:
    """max |Δ| between onnxruntime's text_embeds and the torch tower's on `texts` (one batch, then one by one)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    ids = bundle.tokenize(list(texts))
    with torch.no_grad():
        ref = bundle.tower.eval()(ids).float().numpy()
    (batch,) = session.run([TEXT_EMBEDS], {INPUT_IDS: ids.numpy()})
    one = np.concatenate([session.run([TEXT_EMBEDS], {INPUT_IDS: ids[i:i + 1].numpy()})[0] for i in range(len(ids))])
    return float(max(np.abs(batch - ref).max(), np.abs(one - ref).max()))


def _copy_tokenizer(bundle, folder: Path) -> TokenizerSpec:
    """The tokenizer's files into `folder`; its spec with file names relative to the folder's parent."""
    spec = bundle.tokenizer.to_spec()
    folder.mkdir(parents=True, exist_ok=True)
    options = {k: v for k, v in spec.items() if k not in ("kind", "context_length", "tokenizer_json")}
    if spec["kind"] == "open_clip":
        from open_clip.tokenizer import default_bpe

        src = Path(options.pop("bpe_path", None) or default_bpe())
        shutil.copyfile(src, folder / src.name)
        name = src.name
    else:
        name = "tokenizer.json"
        (folder / name).write_text(spec["tokenizer_json"], encoding="utf-8")
    return TokenizerSpec(spec["kind"], (f"{folder.name}/{name}",), int(spec["context_length"]), options)


def export_text_tower(bundle, checkpoint: Path | None, out: Path, name: str, *, family: str, opset: int = 18,
                      tol: float = 1e-4, overwrite: bool = False,
                      templates: tuple[str, ...] | None = None) -> WrittenTextTower:
    """Write NAME_text.onnx, its tokenizer folder and NAME_text.json into `out`, checked against the torch tower
    (the manifest records the parity; a failed check is in the result, not raised). `templates` (default: those
    the checkpoint's zero-shot head was built with, `vit-serve convert --templates`, else "a photo of a {}.")
    go into the manifest: labels at request time are prompted with them."""
    if templates is None:
        templates = bundle.templates or DEFAULT_TEMPLATES
    import onnx
    from vit_export.proto_file import save_proto

    from vit_serve.checkpoints.io import atomic_write
    from vit_serve.manifest import file_sha256

    onnx_path, _, tok_dir = text_targets(out, name)
    out.mkdir(parents=True, exist_ok=True)
    ids = bundle.tokenize(["a photo of a cat.", "a dog"])
    proto, exporter = _export_proto(bundle.tower, ids, opset)

    def write_checked(tmp: str) -> None:  # the checker reads the file: no second serialization of the weights
        save_proto(proto, tmp)
        onnx.checker.check_model(tmp)

    atomic_write(onnx_path, write_checked, overwrite=overwrite)
    err = text_parity(bundle, onnx_path)
    if tok_dir.exists() and overwrite:
        shutil.rmtree(tok_dir)
    tokenizer = _copy_tokenizer(bundle, tok_dir)
    record = TextTowerManifest(
        tokenizer=tokenizer, embedding_dim=bundle.config.embed_dim, logit_scale=bundle.logit_scale,
        logit_bias=bundle.logit_bias, scores="sigmoid" if bundle.sigmoid else "softmax", templates=tuple(templates),
        family=family, source_checkpoint=None if checkpoint is None else str(checkpoint),
        source_checkpoint_sha256=None if checkpoint is None else file_sha256(checkpoint),
        parity={"reference": "torch (vit_serve.text.tower)", "candidate": "onnxruntime CPU", "texts": len(PARITY_TEXTS),
                "max_abs_err": err, "tol": tol, "ok": err <= tol, "exporter": exporter, "opset": opset})
    manifest = record.write(onnx_path)
    return WrittenTextTower(onnx_path, manifest, tok_dir, err, tol, record)
