"""The text tower's export manifest: what `vit-export --text-tower` writes beside `NAME_text.onnx`
(`NAME_text.json`) and what the gateway reads to answer `POST /classify?labels=`.

    NAME.onnx                 the image graph, with its `embedding` output (the image embedding, e.g. CLIP's
                              image_embeds)
    NAME_text.onnx            input_ids int64 [B, L] -> text_embeds float32 [B, E] (not normalised)
    NAME_text.json            this manifest (`TextTowerManifest`)
    NAME_text_tokenizer/      the tokenizer's files (open_clip's BPE vocabulary, or Hugging Face tokenizer files)

Zero-shot logits are open_clip's: normalise(image) . normalise(mean of normalise(prompt embeddings))ᵀ x
exp(logit_scale) (+ logit_bias), then softmax (CLIP) or sigmoid (SigLIP) scores. Pure data: no torch, no
onnxruntime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEXT_SUFFIX = "_text"
TOKENIZER_SUFFIX = "_text_tokenizer"
INPUT_IDS = "input_ids"
TEXT_EMBEDS = "text_embeds"
FORMAT = "vit-serve-text-tower/1"
TOKENIZER_KINDS = ("open_clip", "hf")
SCORE_KINDS = ("softmax", "sigmoid")
DEFAULT_TEMPLATES = ("a photo of a {}.",)  # open_clip's zero-shot default, as `vit-serve convert --zero-shot`


def text_path_of(path: str | Path) -> Path:
    """`dir/NAME.onnx` (or any model file of NAME) -> `dir/NAME_text.onnx`."""
    p = Path(path)
    return p.with_name(f"{p.stem}{TEXT_SUFFIX}.onnx")


def text_manifest_path(onnx_path: str | Path) -> Path:
    """`dir/NAME_text.onnx` -> `dir/NAME_text.json`."""
    return Path(onnx_path).with_suffix(".json")


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer: `kind` "open_clip" (open_clip's BPE, `files` its vocabulary) or "hf" (Hugging Face
    `tokenizers`, `files` tokenizer.json and the rest of the folder); `files` relative to the manifest's folder;
    texts become `context_length` ids (padded / truncated as the source library does)."""

    kind: str
    files: tuple[str, ...]
    context_length: int
    options: dict[str, Any] = field(default_factory=dict)  # the tokenizer's own settings (e.g. clean, pad id)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": list(self.files), "context_length": self.context_length,
                "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: Any, source: str) -> TokenizerSpec:
        if not isinstance(d, dict):
            raise ValueError(f"{source}: 'tokenizer' must be an object")
        kind, files, length = d.get("kind"), d.get("files"), d.get("context_length")
        if kind not in TOKENIZER_KINDS:
            raise ValueError(f"{source}: tokenizer kind {kind!r} is not one of {', '.join(TOKENIZER_KINDS)}")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise ValueError(f"{source}: tokenizer 'files' must be a non-empty list of file names")
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"{source}: tokenizer 'context_length' must be a positive integer")
        options = d.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"{source}: tokenizer 'options' must be an object")
        return cls(kind, tuple(files), length, options)


@dataclass(frozen=True)
class TextTowerManifest:
    """A text tower export: its tokenizer, the embedding width E (= the image embedding's), the zero-shot
    head's `logit_scale` (open_clip's parameter, a log: logits are multiplied by exp(logit_scale)) and
    `logit_bias` (SigLIP; None for CLIP), how logits become scores, the prompt templates labels are put in (their
    normalised embeddings averaged, as open_clip's zero-shot recipe), the family, the checkpoint it came from, and
    the parity check of the ONNX graph against the torch tower."""

    tokenizer: TokenizerSpec
    embedding_dim: int
    logit_scale: float
    logit_bias: float | None = None
    scores: str = "softmax"
    templates: tuple[str, ...] = DEFAULT_TEMPLATES
    family: str = "clip"
    source_checkpoint: str | None = None
    source_checkpoint_sha256: str | None = None
    parity: dict[str, Any] | None = None
    format: str = FORMAT

    def __post_init__(self) -> None:
        if self.scores not in SCORE_KINDS:
            raise ValueError(f"scores {self.scores!r} is not one of {', '.join(SCORE_KINDS)}")
        if not self.templates or not all(isinstance(t, str) and "{}" in t for t in self.templates):
            raise ValueError("templates must be a non-empty list of strings, each with a {} for the label")

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "family": self.family, "tokenizer": self.tokenizer.to_dict(),
                "embedding_dim": self.embedding_dim, "logit_scale": self.logit_scale, "logit_bias": self.logit_bias,
                "scores": self.scores, "templates": list(self.templates), "inputs": {INPUT_IDS: "int64 [B, L]"},
                "outputs": {TEXT_EMBEDS: "float32 [B, E]"}, "source_checkpoint": self.source_checkpoint,
                "source_checkpoint_sha256": self.source_checkpoint_sha256, "parity": self.parity}

    @classmethod
    def from_dict(cls, d: Any, source: str) -> TextTowerManifest:
        """The manifest from its JSON object; ValueError naming `source` and the field at fault."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{source}: not a text tower manifest (expected format {FORMAT!r})")
        dim, scale, bias = d.get("embedding_dim"), d.get("logit_scale"), d.get("logit_bias")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"{source}: 'embedding_dim' must be a positive integer")
        for name, v in (("logit_scale", scale), ("logit_bias", bias)):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)) and not (name == "logit_bias"
                                                                                      and v is None):
                raise ValueError(f"{source}: {name!r} must be a number")
        templates = d.get("templates", list(DEFAULT_TEMPLATES))
        if not isinstance(templates, list):
            raise ValueError(f"{source}: 'templates' must be a list")
        try:
            return cls(TokenizerSpec.from_dict(d.get("tokenizer"), source), dim, float(scale),
                       None if bias is None else float(bias), d.get("scores", "softmax"), tuple(templates),
                       str(d.get("family", "clip")), d.get("source_checkpoint"), d.get("source_checkpoint_sha256"),
                       d.get("parity"))
        except ValueError as e:
            if str(e).startswith(source):
                raise
            raise ValueError(f"{source}: {e}") from None

    def write(self, onnx_path: str | Path) -> Path:
        """Write beside `NAME_text.onnx` as `NAME_text.json`; returns its path."""
        path = text_manifest_path(onnx_path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, onnx_path: str | Path) -> TextTowerManifest:
        """The manifest beside `NAME_text.onnx`; FileNotFoundError / ValueError naming the file."""
        path = text_manifest_path(onnx_path)
        if not path.is_file():
            raise FileNotFoundError(f"{path.name} is missing beside {Path(onnx_path).name} (vit-export --text-tower "
                                    f"writes both)")
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not readable JSON ({e})") from None
        return cls.from_dict(doc, str(path))

    def tokenizer_files(self, onnx_path: str | Path) -> list[Path]:
        """The tokenizer's files as paths (relative to the manifest's folder)."""
        folder = Path(onnx_path).parent
        return [folder / f for f in self.tokenizer.files]
