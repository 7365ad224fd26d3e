"""The export manifest: what `vit-export` writes beside every graph and engine, and what every reader reads.

    <name>.onnx -> <name>.json    <name>_explain.onnx -> <name>_explain.json    model_smXY.plan -> model_smXY.json
    <name>_openvino/<name>.xml -> <name>_openvino/<name>.json   (format "openvino": the OpenVINO IR, + .bin)

each an `ExportManifest` as JSON; every model config of a Triton repository written by `vit-export` carries a
`TritonMeta` as its "vit_serve" parameter (so that a gateway needs nothing but `get_model_config`). The exporter
writes through `write_manifest` / `TritonMeta.to_json`; the gateway, the Triton repository writer and the Triton
Python models read through `read_manifest` / `ExportManifest.from_dict` / `TritonMeta.from_config`. Nothing else
indexes these dicts with string keys.

Schema 2 (this module) reads schema 1 files (the "sidecars" written before it) unchanged. What 2 changed:
- the version key is "manifest_version" (1 wrote "sidecar_version"; Triton metadata had none);
- an engine manifest's "precision" is the engine's (1 copied the ONNX graph's; the engine's was only under
  "tensorrt"), and its "parity" stays the ONNX graph's check, the engine's own being under "tensorrt";
- the Triton metadata's "rollout" holds every rollout setting (1: head_fusion and discard_ratio; pool beside it).
Every other key and its meaning is as in 1, so a gateway of schema 1 still reads files of schema 2.
Issue 21 added two optional keys to schema 2 (absent in older files, which read as before): "embedding" (`Embedding`:
which image embedding the graph's "embedding" output is, its dimension, whether it is meant to be compared
L2-normalised) and "scores" ("softmax" | "sigmoid": how the head's logits become scores). Issue 23 added a third,
"token_merging" (`TokenMergingRecord`: the r merged in each layer and proportional attention, for a graph exported
with `vit-export --tome`, whose merging runs in the graph). Issue 24 added a fourth, "reference"
(`vit_serve.reference_sketch.Reference.to_dict`: the training data's sketch that OOD scores and drift compare with; in a
Triton repository, on the logits model's metadata only). Issue 42 added a fifth, "embedding_space"
(`vit_serve.fingerprint.EmbeddingSpace.to_dict`: what decides the vectors, and their fingerprint). A reader older
than them refuses such a file naming the key ("written by a newer vit-export?").

The rollout defaults are `vit_serve.rollout_options.DEFAULT_HEAD_FUSION` / `DEFAULT_DISCARD_RATIO`, defined once
there. This module needs none of the math (neither `explain` nor `monitor`): only the options and types it records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vit_serve.fingerprint import EmbeddingSpace, resample_of
from vit_serve.preprocess import PreprocessConfig
from vit_serve.reference_sketch import Reference
from vit_serve.rollout_options import DEFAULT_DISCARD_RATIO, DEFAULT_HEAD_FUSION, HEAD_FUSIONS, check_rollout_options

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
VERSION_KEY = "manifest_version"
V1_VERSION_KEY = "sidecar_version"
FORMATS = ("onnx", "tensorrt", "openvino")
TRITON_KINDS = ("logits", "explain", "preprocess", "ensemble")
SCORES = ("softmax", "sigmoid")  # = vit_serve.config.SCORES
# Which image embedding a model gives: timm's pre-logits (the 2020 ViT, DeiT), Hugging Face's pooler_output
# (DINOv2, SigLIP, CLIP without projection), CLIP's projected image_embeds, open_clip's encode_image.
EMBEDDING_KINDS = ("pre_logits", "pooler_output", "image_embeds", "encode_image")

Resolution = tuple[int, int] | Literal["dynamic"]
Batch = int | Literal["dynamic"]
_REQUIRED: Any = object()


# The graphs' tensor names, the one spelling that the exporter, the manifest, the backends, Triton's configs and
# the /v2 protocol share: the input, and the outputs `vit-export --outputs` can ask for.
PIXEL_VALUES = "pixel_values"
LOGITS = "logits"
EMBEDDING = "embedding"
ROLLOUT = "rollout"
OUTPUT_NAMES = (LOGITS, EMBEDDING, ROLLOUT)
# Not a graph's output: the gateway's /v2 output (and predict's column) of the OOD score it computes from the
# logits graph's outputs for a model with a reference (`vit_serve.monitor`).
OOD_SCORE = "ood_score"
# The embedding space's fingerprint (`vit_serve.fingerprint`) wherever vectors are given: /embed's field, predict's
# column, a Triton model config's parameter.
EMBEDDING_FINGERPRINT = "embedding_fingerprint"


# A Triton model's version folder written by `vit-export --format triton` holds the graph as Triton names it,
# `model.onnx`, and its manifest as `sidecar.json` beside it.
TRITON_ONNX = "model.onnx"
TRITON_MANIFEST = "sidecar.json"


def manifest_path(export_path: str | os.PathLike) -> Path:
    """`dir/name.onnx` (or `.plan`, `.engine`) -> `dir/name.json`."""
    return Path(export_path).with_suffix(".json")


def find_manifest(export_path: str | os.PathLike) -> Path:
    """Where the manifest of an exported file is: `dir/name.json`, or, in a Triton model's version folder
    (`dir/model.onnx` with `dir/sidecar.json`, no `dir/model.json`), `dir/sidecar.json`."""
    path = Path(export_path)
    side = manifest_path(path)
    triton = path.with_name(TRITON_MANIFEST)
    if not side.is_file() and path.name == TRITON_ONNX and triton.is_file():
        return triton
    return side


# ---- typed reading of one JSON object --------------------------------------------------------------------------


def _kind(v: Any) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x > 0 for x in v)


class _Obj:
    """One JSON object of a manifest; every error names the file (`source`) and the field's dotted path."""

    def __init__(self, data: Any, source: str, path: str = "") -> None:
        if not isinstance(data, dict):
            what = f"field {path!r}" if path else "the manifest"
            raise ValueError(f"{source}: {what} must be a JSON object, got {_kind(data)}")
        self.data, self.source, self.path = data, source, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, expected: str) -> ValueError:
        return ValueError(f"{self.source}: field {self.name(key)!r} must be {expected}, got "
                          f"{json.dumps(self.data[key])[:80]}")

    def get(self, key: str, ok: Callable[[Any], bool], expected: str, default: Any = _REQUIRED,
            null: bool = False) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise ValueError(f"{self.source}: missing field {self.name(key)!r} (vit-export writes it)")
            return default
        v = self.data[key]
        if (v is None and null) or (v is not None and ok(v)):
            return v
        raise self.error(key, expected + (" or null" if null else ""))

    def str(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        return self.get(key, lambda v: isinstance(v, str), "a string", default, null)

    def int(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        return self.get(key, _is_int, "an integer", default, null)

    def float(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        v = self.get(key, _is_num, "a number", default, null)
        return float(v) if _is_num(v) else v

    def bool(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        return self.get(key, lambda v: isinstance(v, bool), "true or false", default, null)

    def obj(self, key: str, default: Any = _REQUIRED, null: bool = False) -> Any:
        v = self.get(key, lambda v: isinstance(v, dict), "a JSON object", default, null)
        return _Obj(v, self.source, self.name(key)) if isinstance(v, dict) else v

    def choice(self, key: str, choices: tuple[str, ...], default: Any = _REQUIRED) -> Any:
        return self.get(key, lambda v: v in choices, f"one of {', '.join(choices)}", default)

    def labels(self, key: str) -> tuple[str, ...] | None:
        v = self.get(key, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings",
                     None, null=True)
        return None if v is None else tuple(v)

    def resolution(self, key: str) -> Resolution:
        v = self.get(key, lambda v: v == "dynamic" or _is_pair(v), '[H, W] (positive integers) or "dynamic"')
        return "dynamic" if v == "dynamic" else (v[0], v[1])

    def pair(self, key: str) -> tuple[int, int]:
        v = self.get(key, _is_pair, "[H, W] (positive integers)")
        return v[0], v[1]

    def preprocess(self, key: str) -> PreprocessConfig:
        d = self.get(key, lambda v: isinstance(v, dict), "a JSON object (the preprocessing contract)")
        try:
            return PreprocessConfig.from_dict(d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.source}: field {self.name(key)!r}: {e}") from e

    def unknown(self, known: set[str]) -> None:
        extra = sorted(k for k in self.data if k not in known)
        if extra:
            raise ValueError(f"{self.source}: unknown field(s) {', '.join(map(repr, extra))} in "
                             f"{self.path or 'the manifest'} (written by a newer vit-export?)")


def _version(obj: _Obj, keys: tuple[str, ...], absent: int | None) -> int:
    for key in keys:
        if key in obj.data:
            v = obj.int(key)
            if v not in READABLE_VERSIONS:
                raise ValueError(f"{obj.source}: unknown manifest version {v} (field {key!r}); this vit-serve reads "
                                 f"versions {', '.join(map(str, READABLE_VERSIONS))}: upgrade vit-serve or re-export")
            return v
    if absent is None:
        raise ValueError(f"{obj.source}: missing field {keys[0]!r}: not a vit-export manifest")
    return absent


# ---- the parts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutSettings:
    """How an explain graph computes attention rollout (fixed at export): head fusion, discard ratio, and (when
    known) the pooling and the number of prefix tokens of the model it was exported from."""

    head_fusion: str = DEFAULT_HEAD_FUSION
    discard_ratio: float = DEFAULT_DISCARD_RATIO
    pool: str | None = None
    num_prefix_tokens: int | None = None

    def __post_init__(self) -> None:
        check_rollout_options(self.head_fusion, self.discard_ratio)

    def matches(self, head_fusion: str, discard_ratio: float) -> bool:
        """Whether these are the settings asked for (discard ratios equal to rounding)."""
        return head_fusion == self.head_fusion and abs(discard_ratio - self.discard_ratio) < 1e-9

    def to_dict(self) -> dict[str, Any]:
        return {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio, "pool": self.pool,
                "num_prefix_tokens": self.num_prefix_tokens}

    @classmethod
    def _read(cls, o: _Obj) -> RolloutSettings:
        try:
            return cls(o.choice("head_fusion", HEAD_FUSIONS), o.float("discard_ratio"),
                       o.str("pool", None, null=True), o.int("num_prefix_tokens", None, null=True))
        except ValueError as e:
            if o.source in str(e):
                raise
            raise ValueError(f"{o.source}: field {o.path!r}: {e}") from e


@dataclass(frozen=True)
class Embedding:
    """The image embedding a model gives (its "embedding" output, POST /embed): `kind` (EMBEDDING_KINDS), its
    dimension E, and whether it is meant to be compared L2-normalised (CLIP, SigLIP: cosine similarity).
    `matryoshka_dims`: the nested sizes the model was trained to be truncated to (Matryoshka representation
    learning: the leading d dimensions, renormalised, are an embedding themselves), ascending, each at most E;
    None: not trained so (POST /v1/embeddings refuses `dimensions` then)."""

    kind: str
    dim: int
    normalized: bool = False
    matryoshka_dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in EMBEDDING_KINDS:
            raise ValueError(f"unknown embedding kind {self.kind!r}; expected one of {', '.join(EMBEDDING_KINDS)}")
        dims = self.matryoshka_dims
        if dims is not None:
            dims = tuple(dims)
            if (not dims or any(not _is_int(d) or not 1 <= d <= self.dim for d in dims)
                    or list(dims) != sorted(set(dims))):
                raise ValueError(f"matryoshka_dims must be ascending whole numbers from 1 to the embedding's "
                                 f"{self.dim}, got {list(dims)}")
            object.__setattr__(self, "matryoshka_dims", dims)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "dim": self.dim, "normalized": self.normalized}
        if self.matryoshka_dims is not None:  # absent otherwise: manifests written before it read the same
            d["matryoshka_dims"] = list(self.matryoshka_dims)
        return d

    @classmethod
    def _read(cls, o: _Obj) -> Embedding:
        o.unknown({"kind", "dim", "normalized", "matryoshka_dims"})
        dims = o.get("matryoshka_dims", lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
                     "a list of whole numbers", None, null=True)
        try:
            return cls(o.choice("kind", EMBEDDING_KINDS), o.int("dim"), o.bool("normalized"),
                       None if dims is None else tuple(int(x) for x in dims))
        except ValueError as e:
            raise ValueError(f"{o.source}: field {o.path!r}: {e}") from None


def embedding_of(cfg: Any) -> Embedding:
    """The Embedding of a model's config (a `vit_serve.config.ViTConfig`, read by its fields): a converter's
    `cfg.extra["embedding_kind"]` when it set one (open_clip: "encode_image"), else by family: CLIP with a
    projection "image_embeds", DINOv2 / DINOv3 / SigLIP / CLIP without one "pooler_output" (DINOv3's: the class
    token, as upstream and HF's `pooler_output`), the 2020 ViT, DeiT and the other Eva families
    "pre_logits". Normalised: CLIP and SigLIP (their embeddings are compared by cosine). Matryoshka sizes: a
    converter's or trainer's `cfg.extra["matryoshka_dims"]`."""
    family = getattr(cfg, "family", "vit")
    kind = (getattr(cfg, "extra", None) or {}).get("embedding_kind")
    if kind is None:
        if family == "clip" and getattr(cfg, "proj_dim", None):
            kind = "image_embeds"
        elif family in ("dinov2", "dinov3", "siglip", "clip"):
            kind = "pooler_output"
        else:
            kind = "pre_logits"
    dims = (getattr(cfg, "extra", None) or {}).get("matryoshka_dims")
    return Embedding(kind, int(cfg.embed_dim_out), family in ("clip", "siglip"),
                     None if dims is None else tuple(int(d) for d in dims))


def embedding_space_of(weights: str, cfg: Any, preprocess: PreprocessConfig, precision: str,
                       token_merging: TokenMergingRecord | None = None, trained: Any = None,
                       resample_mode: str | None = None) -> EmbeddingSpace:
    """The `EmbeddingSpace` of a model (its config `cfg`, read by its fields, and `weights_digest` of its tensors as
    loaded) served with `preprocess` (at its input_size), `precision` and `token_merging`. trained: the config
    before an export resized it (`--patch-size`; default `cfg`); resample_mode: the position embedding's (default
    the config's). The one constructor the exporter and the backends share, so that the same model at the same
    settings gets the same fingerprint whichever of them runs it."""
    trained = trained or cfg
    emb = embedding_of(cfg)
    served = preprocess.input_size
    resample = resample_of(served, (int(trained.img_size[0]), int(trained.img_size[1])), int(cfg.patch_size),
                           int(trained.patch_size), resample_mode or cfg.resample_mode)
    extra = getattr(cfg, "extra", None) or {}
    return EmbeddingSpace(weights, emb.kind, str(cfg.pool), emb.dim, preprocess.to_dict(), int(cfg.patch_size),
                          precision, False, resample, extra.get("max_patches"),
                          None if token_merging is None else (token_merging.r, token_merging.prop_attn))


@dataclass(frozen=True)
class TokenMergingRecord:
    """The token merging (ToMe) a graph runs (`vit-export --tome`): r tokens merged in each layer, one entry per
    layer, and whether attention is proportional to the merged tokens' sizes (`vit_serve.tome`). min_grid: a
    dynamic-resolution graph's smallest side in patches (from it up, every layer merges exactly its r, as traced:
    `vit_serve.tome.fewest_patches`); None for a static graph."""

    r: tuple[int, ...]
    prop_attn: bool = True
    min_grid: int | None = None

    def __post_init__(self) -> None:
        if not self.r or any(not _is_int(v) or v < 0 for v in self.r):
            raise ValueError(f"token_merging: r must be whole numbers >= 0, one per layer, got {list(self.r)}")

    @classmethod
    def of(cls, setting: Any, min_grid: int | None = None) -> TokenMergingRecord | None:
        """The record of a model's setting (`VisionTransformer.token_merging`, a `vit_serve.tome.TokenMerging`,
        read by its fields; None: no merging)."""
        return None if setting is None else cls(tuple(setting.r), bool(setting.prop_attn), min_grid)

    def to_dict(self) -> dict[str, Any]:
        return {"r": list(self.r), "prop_attn": self.prop_attn, "min_grid": self.min_grid}

    @classmethod
    def _read(cls, o: _Obj) -> TokenMergingRecord:
        o.unknown({"r", "prop_attn", "min_grid"})
        r = o.get("r", lambda v: isinstance(v, list) and bool(v) and all(_is_int(x) and x >= 0 for x in v),
                  "a list of whole numbers >= 0 (one per layer)")
        return cls(tuple(int(v) for v in r), o.bool("prop_attn", True), o.int("min_grid", None, null=True))


@dataclass(frozen=True)
class SourceCheckpoint:
    """The checkpoint an export was made from."""

    path: str
    sha256: str


@dataclass(frozen=True)
class Architecture:
    """The exported model's architecture: patch_size is the graph's; trained_resolution and trained_patch_size
    are the source checkpoint's, before the export resampled it (`vit-export --res`, FlexiViT's `--patch-size`).
    trained_patch_size is absent from manifests written before it (read as patch_size)."""

    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    hybrid: bool
    pool: str
    trained_resolution: tuple[int, int]
    trained_patch_size: int | None = None

    def __post_init__(self) -> None:
        if self.trained_patch_size is None:
            object.__setattr__(self, "trained_patch_size", self.patch_size)

    def to_dict(self) -> dict[str, Any]:
        out = {"patch_size": self.patch_size, "embed_dim": self.embed_dim, "depth": self.depth,
               "num_heads": self.num_heads, "hybrid": self.hybrid, "pool": self.pool,
               "trained_resolution": list(self.trained_resolution)}
        if self.trained_patch_size != self.patch_size:  # written only for a resized export (older files: absent)
            out["trained_patch_size"] = self.trained_patch_size
        return out

    @classmethod
    def _read(cls, o: _Obj) -> Architecture:
        patch = o.int("patch_size")
        return cls(patch, o.int("embed_dim"), o.int("depth"), o.int("num_heads"), o.bool("hybrid"),
                   o.str("pool"), o.pair("trained_resolution"), o.int("trained_patch_size", patch))


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, numpy dtype name, shape (symbolic dims as strings)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class IOSpec:
    """The graph's inputs and outputs."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    @classmethod
    def from_dict(cls, data: Any, source: str = "io") -> IOSpec:
        return cls._read(_Obj(data, source, "io"))

    @classmethod
    def _read(cls, o: _Obj) -> IOSpec:
        def tensors(key: str) -> tuple[TensorSpec, ...]:
            items = o.get(key, lambda v: isinstance(v, list), "a list of tensors")
            out = []
            for i, item in enumerate(items):
                t = _Obj(item, o.source, f"{o.name(key)}[{i}]")
                shape = t.get("shape", lambda v: isinstance(v, list) and all(_is_int(d) or isinstance(d, str)
                                                                            for d in v), "a list of dims")
                out.append(TensorSpec(t.str("name"), t.str("dtype"), tuple(shape)))
            return tuple(out)

        return cls(tensors("inputs"), tensors("outputs"))


@dataclass(frozen=True)
class Parity:
    """A parity check as stored: `vit_export.parity.ParityReport.to_dict` (onnx, runtime) for a graph, or
    `vit_export.tensorrt_build.compare_runtimes` (reference, candidate) for an engine. rows: ParityRow's fields."""

    ok: bool
    precision: str
    criteria: str
    rows: tuple[dict[str, Any], ...]
    onnx: str | None = None
    runtime: str | None = None
    reference: str | None = None
    candidate: str | None = None

    _KEYS = ("onnx", "runtime", "reference", "candidate")

    def to_dict(self) -> dict[str, Any]:
        named = {k: getattr(self, k) for k in self._KEYS if getattr(self, k) is not None}
        return {**named, "precision": self.precision, "criteria": self.criteria, "ok": self.ok,
                "rows": [dict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data: Any, source: str = "parity") -> Parity:
        """The one reader of a parity report (ValueError naming `source` and the field)."""
        return cls._read(_Obj(data, source, "parity"))

    @classmethod
    def _read(cls, o: _Obj) -> Parity:
        rows = o.get("rows", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v),
                     "a list of objects")
        o.unknown({*cls._KEYS, "precision", "criteria", "ok", "rows"})
        return cls(o.bool("ok"), o.str("precision"), o.str("criteria"), tuple(rows),
                   *(o.str(k, None, null=True) for k in cls._KEYS))


@dataclass(frozen=True)
class Int8Quantization:
    """An int8 graph's quantization: the scheme written, the side-by-side comparison of the schemes
    (`vit_export.quantize`'s report, a JSON object), and what its parity refers to."""

    scheme: str
    comparison: dict[str, Any]
    parity_note: str


@dataclass(frozen=True)
class TensorRTBuild:
    """How an engine was built (`vit_export.tensorrt_build.build_engine`'s result) and its own parity check."""

    path: str
    file: str
    compute_capability: str
    version: str
    precision: str
    graph_precision: str
    strongly_typed: bool
    batch: tuple[int, int, int]
    build_s: float
    timing_cache: dict[str, Any] | None = None
    parity: Parity | None = None
    built_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"path": self.path, "file": self.file, "compute_capability": self.compute_capability,
               "tensorrt": self.version, "precision": self.precision, "graph_precision": self.graph_precision,
               "strongly_typed": self.strongly_typed, "batch": list(self.batch), "build_s": self.build_s,
               "timing_cache": self.timing_cache, "parity": None if self.parity is None else self.parity.to_dict()}
        if self.built_from is not None:
            out["built_from"] = self.built_from
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "tensorrt") -> TensorRTBuild:
        return cls._read(_Obj(data, source, "tensorrt"))

    @classmethod
    def _read(cls, o: _Obj) -> TensorRTBuild:
        batch = o.get("batch", lambda v: isinstance(v, list) and len(v) == 3 and all(_is_int(b) for b in v),
                      "[min, opt, max] batch sizes")
        timing = o.obj("timing_cache", None, null=True)
        parity = o.obj("parity", None, null=True)
        o.unknown({"path", "file", "compute_capability", "tensorrt", "precision", "graph_precision",
                   "strongly_typed", "batch", "build_s", "timing_cache", "parity", "built_from"})
        return cls(o.str("path"), o.str("file"), o.str("compute_capability"), o.str("tensorrt"), o.str("precision"),
                   o.str("graph_precision"), o.bool("strongly_typed"), (batch[0], batch[1], batch[2]),
                   o.float("build_s"), None if timing is None else timing.data,
                   None if parity is None else Parity._read(parity), o.str("built_from", None))


# ---- the manifest ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportManifest:
    """What one exported file is and how it was checked (the JSON beside it).

    resolution: the graph's static (H, W), or "dynamic" (any multiple of the patch size; served at the
    preprocessing contract's input_size). preprocess: the contract at that resolution. io: the graph's tensors.
    rollout: the explain graph's fixed settings (None for a logits graph). parity: the check of the ONNX graph
    (for an engine: of the graph it was built from; the engine's own check is `tensorrt.parity`).
    source_onnx / tensorrt: engines only. token_merging: the ToMe the graph runs (None: none). reference: the
    in-distribution sketch of the model as this graph computes it (None: none; `vit_serve.monitor`).
    """

    file: str
    file_sha256: str
    format: Literal["onnx", "tensorrt", "openvino"]
    source_checkpoint: SourceCheckpoint | None
    architecture: Architecture
    resolution: Resolution
    resample_mode: str
    batch: Batch
    opset: int
    precision: str
    explain: bool
    exporter: str
    checker: str
    preprocess: PreprocessConfig
    labels: tuple[str, ...] | None
    io: IOSpec
    rollout: RolloutSettings | None = None
    parity: Parity | None = None
    versions: dict[str, str] = field(default_factory=dict)
    int8: Int8Quantization | None = None
    source_onnx: str | None = None
    tensorrt: TensorRTBuild | None = None
    embedding: Embedding | None = None
    scores: str | None = None
    token_merging: TokenMergingRecord | None = None
    reference: Reference | None = None
    embedding_space: EmbeddingSpace | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def score_fn(self) -> str:
        """How the logits become scores: "softmax" (files that do not say) or "sigmoid"."""
        return self.scores or "softmax"

    @property
    def dynamic_resolution(self) -> bool:
        return self.resolution == "dynamic"

    @property
    def serving_resolution(self) -> tuple[int, int]:
        """The (H, W) a server feeds: the static resolution, or the contract's input_size for a dynamic graph."""
        return self.preprocess.input_size if self.resolution == "dynamic" else self.resolution

    @property
    def embedding_dim(self) -> int:
        """D of the graph's "embedding" output (`vit-export --outputs logits,embedding`), 0 when it has none."""
        emb = self.io.output(EMBEDDING)
        return int(emb.shape[-1]) if emb is not None and emb.shape and _is_int(emb.shape[-1]) else 0

    @property
    def num_classes(self) -> int:
        """K, from the logits output's last dim, else from the labels."""
        logits = self.io.output(LOGITS)
        if logits is not None and logits.shape and _is_int(logits.shape[-1]):
            return int(logits.shape[-1])
        if self.labels:
            return len(self.labels)
        raise ValueError(f"{self.file}: the manifest states neither the logits shape nor the labels: cannot tell "
                         "the class count")

    @property
    def parity_ok(self) -> bool | None:
        """Whether the file passed its parity check (None: not checked)."""
        return None if self.parity is None else self.parity.ok

    def to_dict(self) -> dict[str, Any]:
        """The JSON layout (schema 2; keys as schema 1 but the version key)."""
        out: dict[str, Any] = {
            VERSION_KEY: SCHEMA_VERSION,
            "file": self.file,
            "file_sha256": self.file_sha256,
            "format": self.format,
            "source_checkpoint": None if self.source_checkpoint is None else {
                "path": self.source_checkpoint.path, "sha256": self.source_checkpoint.sha256},
            "architecture": self.architecture.to_dict(),
            "resolution": "dynamic" if self.resolution == "dynamic" else list(self.resolution),
            "resample_mode": self.resample_mode,
            "batch": self.batch,
            "opset": self.opset,
            "precision": self.precision,
            "explain": self.explain,
            "exporter": self.exporter,
            "onnx_checker": self.checker,
            "preprocess": self.preprocess.to_dict(),
            "labels": None if self.labels is None else list(self.labels),
            "io": self.io.to_dict(),
            "parity": None if self.parity is None else self.parity.to_dict(),
            "versions": dict(self.versions),
        }
        if self.rollout is not None:
            out["rollout"] = self.rollout.to_dict()
        if self.int8 is not None:
            out.update(int8_scheme=self.int8.scheme, int8=self.int8.comparison, parity_note=self.int8.parity_note)
        if self.source_onnx is not None:
            out["source_onnx"] = self.source_onnx
        if self.tensorrt is not None:
            out["tensorrt"] = self.tensorrt.to_dict()
        _write_optional(out, self.embedding, self.scores, self.token_merging, self.reference, self.embedding_space)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "manifest") -> ExportManifest:
        """Read schema 1 or 2; ValueError naming `source` (the file) and the field when anything is off."""
        o = _Obj(data, source)
        version = _version(o, (VERSION_KEY, V1_VERSION_KEY), None)
        if version == 2:
            o.unknown({VERSION_KEY, "file", "file_sha256", "format", "source_checkpoint", "architecture",
                       "resolution", "resample_mode", "batch", "opset", "precision", "explain", "exporter",
                       "onnx_checker", "preprocess", "labels", "io", "parity", "versions", "rollout", "int8_scheme",
                       "int8", "parity_note", "source_onnx", "tensorrt", "embedding", "scores",
                       "token_merging", "reference", "embedding_space"})
        ckpt = o.obj("source_checkpoint", null=True)
        explain = o.bool("explain")
        rollout = o.obj("rollout", None, null=True)
        if explain and rollout is None:
            raise ValueError(f"{source}: missing field 'rollout' (an explain graph states its rollout settings)")
        versions = o.get("versions", lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                         "an object of version strings", {})
        int8 = None
        if "int8_scheme" in o.data:
            int8 = Int8Quantization(o.str("int8_scheme"), o.obj("int8").data, o.str("parity_note"))
        parity = o.obj("parity", None, null=True)
        trt = o.obj("tensorrt", None, null=True)
        return cls(
            file=o.str("file"),
            file_sha256=o.str("file_sha256"),
            format=o.choice("format", FORMATS),
            source_checkpoint=None if ckpt is None else SourceCheckpoint(ckpt.str("path"), ckpt.str("sha256")),
            architecture=Architecture._read(o.obj("architecture")),
            resolution=o.resolution("resolution"),
            resample_mode=o.str("resample_mode"),
            batch=o.get("batch", lambda v: v == "dynamic" or (_is_int(v) and v > 0),
                        'a positive integer or "dynamic"'),
            opset=o.int("opset"),
            precision=o.str("precision"),
            explain=explain,
            exporter=o.str("exporter"),
            checker=o.str("onnx_checker"),
            preprocess=o.preprocess("preprocess"),
            labels=o.labels("labels"),
            io=IOSpec._read(o.obj("io")),
            rollout=None if rollout is None else RolloutSettings._read(rollout),
            parity=None if parity is None else Parity._read(parity),
            versions=dict(versions),
            int8=int8,
            source_onnx=o.str("source_onnx", None, null=True),
            tensorrt=None if trt is None else TensorRTBuild._read(trt),
            **_read_optional(o),
            schema_version=version,
        )


def _write_optional(out: dict[str, Any], embedding: Embedding | None, scores: str | None,
                    token_merging: TokenMergingRecord | None, reference: Reference | None = None,
                    space: EmbeddingSpace | None = None) -> None:
    """The optional keys issues 21, 23, 24 and 42 added, written only when stated (older files read back as they
    were)."""
    if embedding is not None:
        out["embedding"] = embedding.to_dict()
    if scores is not None:
        out["scores"] = scores
    if token_merging is not None:
        out["token_merging"] = token_merging.to_dict()
    if reference is not None:
        out["reference"] = reference.to_dict()
    if space is not None:
        out["embedding_space"] = space.to_dict()


def _read_optional(o: _Obj) -> dict[str, Any]:
    emb = o.obj("embedding", None, null=True)
    tome = o.obj("token_merging", None, null=True)
    ref = o.obj("reference", None, null=True)
    try:
        reference = None if ref is None else Reference.from_dict(ref.data)
    except ValueError as e:
        raise ValueError(f"{o.source}: field {o.name('reference')!r}: {e}") from e
    space = o.obj("embedding_space", None, null=True)
    try:
        embedding_space = None if space is None else EmbeddingSpace.from_dict(space.data)
    except ValueError as e:
        raise ValueError(f"{o.source}: field {o.name('embedding_space')!r}: {e}") from e
    return {"embedding_space": embedding_space,
            "embedding": None if emb is None else Embedding._read(emb),
            "scores": o.choice("scores", SCORES, None),
            "token_merging": None if tome is None else TokenMergingRecord._read(tome),
            "reference": reference}


def read_manifest(path: str | os.PathLike) -> ExportManifest:
    """The manifest of an exported file (`path` is the file, e.g. `name.onnx`, or its `name.json`).

    FileNotFoundError when there is none beside it; ValueError naming the file (and the field) when it is not
    valid JSON, not a vit-export manifest, of an unknown version or has a field of the wrong type."""
    path = Path(path)
    side = path if path.suffix == ".json" else find_manifest(path)
    if not side.is_file():
        raise FileNotFoundError(f"{path} has no sidecar {side.name} beside it (vit-export writes one; it holds the "
                                f"resolution, preprocessing and labels)")
    try:
        data = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{side} is not valid JSON ({e})") from e
    return ExportManifest.from_dict(data, str(side))


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks (the way `file_sha256` is recorded)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_file_sha256(path: str | os.PathLike, manifest: ExportManifest) -> None:
    """ValueError (one line) unless the exported file at `path` has the bytes its manifest records
    (`file_sha256`): a graph and a manifest of different exports, or a copy not yet complete, never load. Reads
    the whole file once: call it when a file is loaded, not per request."""
    path = Path(path)
    got = file_sha256(path)
    if got != manifest.file_sha256.lower():
        raise ValueError(f"{path} does not match its manifest {find_manifest(path).name} (sha256 "
                         f"{got[:12]}... on disk, {manifest.file_sha256[:12]}... recorded): a file of another export "
                         f"or one not completely copied yet; not loaded")


def write_manifest(path: str | os.PathLike, manifest: ExportManifest, overwrite: bool = False) -> Path:
    """Write `manifest` as JSON beside the exported file `path` (or at `path` if it ends in .json), atomically;
    FileExistsError if it exists and not `overwrite`. Returns the JSON's path."""
    from vit_serve.checkpoints.io import atomic_write  # lazy: Triton's Python models import this module

    path = Path(path)
    side = path if path.suffix == ".json" else manifest_path(path)
    text = json.dumps(manifest.to_dict(), indent=2) + "\n"
    return atomic_write(side, text.encode(), overwrite=overwrite)


# ---- the Triton model config's "vit_serve" parameter ------------------------------------------------------------


@dataclass(frozen=True)
class TritonMeta:
    """The export's contract as every model of a `vit-export` Triton repository carries it.

    name: the export's name stem; kind: "logits" | "explain" | "preprocess" | "ensemble"; runtime: what runs it
    in Triton ("onnxruntime", "python", "tensorrt", "ensemble"); resolution/grid: static or "dynamic"; the
    manifests' sha256s tie the model to its export. explain_model / logits_model / classifier name the related
    models; tensorrt: the engine's build summary (compute_capability, file, precision, batch, parity_ok).
    """

    name: str
    kind: str
    runtime: str
    resolution: Resolution
    patch_size: int
    grid: tuple[int, int] | Literal["dynamic"]
    num_classes: int
    labels: tuple[str, ...] | None
    preprocess: PreprocessConfig
    rollout: RolloutSettings
    pool: str
    precision: str | None
    sidecar_sha256: str
    explain_sidecar_sha256: str
    onnx_sha256: str
    source_checkpoint_sha256: str | None
    preprocess_model: str
    explain_model: str | None = None
    logits_model: str | None = None
    classifier: str | None = None
    tensorrt: dict[str, Any] | None = None
    embedding: Embedding | None = None
    scores: str | None = None
    token_merging: TokenMergingRecord | None = None
    reference: Reference | None = None
    embedding_space: EmbeddingSpace | None = None
    schema_version: int = SCHEMA_VERSION

    _LINKS = ("explain_model", "logits_model", "classifier")

    @property
    def serving_resolution(self) -> tuple[int, int]:
        return self.preprocess.input_size if self.resolution == "dynamic" else self.resolution

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            VERSION_KEY: SCHEMA_VERSION, "name": self.name, "kind": self.kind, "runtime": self.runtime,
            "resolution": "dynamic" if self.resolution == "dynamic" else list(self.resolution),
            "patch_size": self.patch_size, "grid": "dynamic" if self.grid == "dynamic" else list(self.grid),
            "num_classes": self.num_classes, "labels": None if self.labels is None else list(self.labels),
            "preprocess": self.preprocess.to_dict(), "rollout": self.rollout.to_dict(), "pool": self.pool,
            "precision": self.precision, "sidecar_sha256": self.sidecar_sha256,
            "explain_sidecar_sha256": self.explain_sidecar_sha256, "onnx_sha256": self.onnx_sha256,
            "source_checkpoint_sha256": self.source_checkpoint_sha256, "preprocess_model": self.preprocess_model,
        }
        out.update({k: getattr(self, k) for k in self._LINKS if getattr(self, k) is not None})
        if self.tensorrt is not None:
            out["tensorrt"] = self.tensorrt
        _write_optional(out, self.embedding, self.scores, self.token_merging, self.reference, self.embedding_space)
        return out

    def to_json(self) -> str:
        """The parameter's string value (compact JSON)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, source: str = "Triton model") -> TritonMeta:
        """Schema 1 (no version key; rollout without pool) or 2; ValueError naming `source` and the field."""
        o = _Obj(data, source)
        version = _version(o, (VERSION_KEY,), 1)
        if version == 2:
            o.unknown({VERSION_KEY, "name", "kind", "runtime", "resolution", "patch_size", "grid", "num_classes",
                       "labels", "preprocess", "rollout", "pool", "precision", "sidecar_sha256",
                       "explain_sidecar_sha256", "onnx_sha256", "source_checkpoint_sha256", "preprocess_model",
                       *cls._LINKS, "tensorrt", "embedding", "scores", "token_merging", "reference",
                       "embedding_space"})
        rollout = RolloutSettings._read(o.obj("rollout"))
        pool = o.str("pool")
        if rollout.pool is None:  # schema 1 kept it beside the rollout settings
            rollout = RolloutSettings(rollout.head_fusion, rollout.discard_ratio, pool, rollout.num_prefix_tokens)
        grid = o.get("grid", lambda v: v == "dynamic" or _is_pair(v), '[gh, gw] or "dynamic"')
        trt = o.obj("tensorrt", None, null=True)
        return cls(
            name=o.str("name"), kind=o.choice("kind", TRITON_KINDS), runtime=o.str("runtime"),
            resolution=o.resolution("resolution"), patch_size=o.int("patch_size"),
            grid="dynamic" if grid == "dynamic" else (grid[0], grid[1]), num_classes=o.int("num_classes"),
            labels=o.labels("labels"), preprocess=o.preprocess("preprocess"), rollout=rollout, pool=pool,
            precision=o.str("precision", None, null=True), sidecar_sha256=o.str("sidecar_sha256"),
            explain_sidecar_sha256=o.str("explain_sidecar_sha256"), onnx_sha256=o.str("onnx_sha256"),
            source_checkpoint_sha256=o.str("source_checkpoint_sha256", null=True),
            preprocess_model=o.str("preprocess_model"),
            **{k: o.str(k, None, null=True) for k in cls._LINKS},
            tensorrt=None if trt is None else trt.data, **_read_optional(o), schema_version=version,
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any], model: str) -> TritonMeta:
        """From a model config as Triton gives it as JSON (`get_model_config`, or a Python model's
        `args["model_config"]`): the "vit_serve" parameter's string value."""
        source = f"Triton model {model!r} (config.pbtxt parameter 'vit_serve')"
        try:
            text = config["parameters"]["vit_serve"]["string_value"]
            data = json.loads(text)
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"Triton model {model!r} has no valid 'vit_serve' parameter in its config.pbtxt; "
                             f"serve a repository written by `vit-export --format triton`") from e
        return cls.from_dict(data, source)
