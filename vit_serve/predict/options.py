"""What `vit-serve predict` can be told: `PredictOptions`, one field per flag (its `vit_serve.flag.Flag` in the
field's metadata; the field order is the order of `vit-serve predict --help`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vit_serve.flag import FLAG_KEY, Flag
from vit_serve.predict.writers import output_format
from vit_serve.tome_schedule import parse_tome


def _flag(help: str, **kw: Any) -> dict[str, Flag]:
    """A field's metadata: its flag."""
    return {FLAG_KEY: Flag(help, **kw)}


@dataclass(frozen=True)
class PredictOptions:
    """What `vit-serve predict` can be told (one field per flag; checked when built: ValueError naming it)."""

    model: str = field(metadata=_flag(
        "a checkpoint, an exported NAME.onnx (NAME.json beside it), an engine, or a repository folder (what "
        "`vit-serve serve REPO` takes; then --model NAME)", metavar="MODEL", positional=True))
    src: str = field(metadata=_flag(
        "a folder (recursive), a glob ('photos/**/*.jpg'), a text file of paths (one a line), one image, or with "
        "--image-folder an ImageFolder root", metavar="SRC", positional=True))
    out: str = field(metadata=_flag("preds.jsonl, preds.csv or preds.parquet (a folder of parts)"))
    task: Literal["classify", "embed", "embed-text"] = field(default="classify", metadata=_flag(
        "classify (default: the top-k), embed (also each image's embedding and the embedding space's "
        "fingerprint, as --embeddings) or embed-text (SRC is a text file of queries, one a line: each embedded "
        "by the model's text tower, with the fingerprint of the image embeddings it is compared with)"))
    model_name: str | None = field(default=None, metadata=_flag(
        "the model of a repository folder (its newest version)", name="--model", metavar="NAME"))
    top_k: int = field(default=5, metadata=_flag("classes per row (default {default})"))
    batch_size: int = field(default=16, metadata=_flag("images per model call (default {default})"))
    # 0: the gateway's default (`default_decode_workers`)
    workers: int = field(default=0, metadata=_flag(
        "decode workers (default: as the gateway, max(2, min(4, cores - model threads)))"))
    processes: bool = field(default=False, metadata=_flag("decode in worker processes instead of threads"))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=_flag("default {default}"))
    backend: Literal["auto", "onnxruntime", "openvino"] = field(default="auto", metadata=_flag(
        "the runtime of an export: auto (as discovered: NAME.onnx onnxruntime, an IR NAME.xml openvino), "
        "onnxruntime or openvino (default {default})"))
    precision: Literal["auto", "f32", "bf16", "f16", "int8"] = field(default="auto", metadata=_flag(
        "OpenVINO's inference precision, behind the accuracy gate (as serve --precision; default {default})"))
    threads: int | None = field(default=None, metadata=_flag(
        "intra-op threads of the model runtime (default: its own)"))
    tome: str | None = field(default=None, metadata=_flag(
        "token merging on a checkpoint (torch backend): R per layer (13), one R per layer (13,13,8) or "
        "R:inflection (16:-1); exports run their own (vit-export --tome)", metavar="R"))
    compile: bool = field(default=False, metadata=_flag(
        "run a checkpoint through torch.compile (inductor), checked against eager at load (as serve --compile)"))
    torchscript: bool = field(default=False, metadata=_flag(
        "run a checkpoint as a TorchScript trace, checked against eager at load (as serve --torchscript)"))
    decode: Literal["fast", "exact", "contract"] = field(default="fast", metadata=_flag(
        "decode path, as `serve --decode` (default {default}, the gateway's default)"))
    max_patches: int | None = field(default=None, metadata=_flag(
        "NaFlex models (SigLIP 2): each whole image at its own aspect ratio, resized to at most N patches (1 to "
        "the model's budget; default: fixed-size input as the contract says)", metavar="N"))
    embeddings: bool = field(default=False, metadata=_flag("add the pre-logits embedding"))
    normalize: bool = field(default=False, metadata=_flag("L2-normalise the embeddings"))
    explain: bool = field(default=False, metadata=_flag(
        "write the attention-rollout maps to OUT.rollout.npy ([N, gh, gw]; each row's rollout_index names its "
        "map)"))
    image_folder: bool = field(default=False, metadata=_flag(
        "SRC is an ImageFolder (SRC/<class>/...): rows also carry target and target_index"))
    max_pixels: int = field(default=50_000_000, metadata=_flag(
        "larger images are skipped as unreadable (default {default})"))
    part_rows: int = field(default=4096, metadata=_flag(
        "Parquet: rows per part file (default {default}; a part is also written every 30 s)"))
    engine: Literal["local", "ray"] = field(default="local", metadata=_flag(
        "local (default) or ray (Ray Data; pip install 'vit-serve[ray]')"))
    address: str | None = field(default=None, metadata=_flag(
        "--engine ray: the cluster (auto, ray://HOST:10001; default: a local one)"))
    # ray: model actors (0: one per GPU, or one per CPU of the cluster)
    actors: int = field(default=0, metadata=_flag(
        "--engine ray: model actors (default: one per GPU, or one per CPU of the cluster)"))
    force: bool = field(default=False, metadata=_flag(
        "replace an OUT written with another model or other settings"))
    quiet: bool = field(default=False, metadata=_flag("no progress bar or per-file lines"))

    def __post_init__(self) -> None:
        for name in ("top_k", "batch_size", "max_pixels", "part_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("workers", "actors"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be 0 (automatic) or more, got {getattr(self, name)}")
        if self.max_patches is not None and self.max_patches < 1:
            raise ValueError(f"--max-patches must be at least 1, got {self.max_patches}")
        if self.max_patches is not None and (self.explain or self.engine == "ray"):
            raise ValueError("--max-patches runs classify and embed on the local engine (not --explain, not "
                             "--engine ray)")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        if self.tome is not None:
            parse_tome(self.tome)  # ValueError with the accepted forms
        if self.task == "embed":
            object.__setattr__(self, "embeddings", True)  # the task is the embedding column (and its fingerprint)
        if self.normalize and not self.embeddings and self.task != "embed-text":
            raise ValueError("--normalize applies to --embeddings; add --embeddings")
        if self.task == "embed-text" and (self.explain or self.image_folder or self.engine != "local"):
            raise ValueError("--task embed-text embeds a text file's lines: not with --explain, --image-folder or "
                             "--engine ray")
        for name, hint in typing.get_type_hints(PredictOptions).items():
            allowed = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
            if allowed is not None and getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.address is not None and self.engine != "ray":
            raise ValueError("--address is for --engine ray")
        output_format(Path(self.out))
