"""Tokenizers for the text towers, nothing downloaded: open_clip's SimpleTokenizer (the BPE vocabulary ships in
the open_clip wheel) and a Hugging Face `tokenizer.json` read with the `tokenizers` library.

Both turn a list of K strings into ids [K, L] (L = the tower's context length), padded and truncated as the
reference does: open_clip's SimpleTokenizer.__call__ (zeros after the end-of-text token, truncation keeps it
last), and for tokenizer.json the tokenizer's own post-processor, padded to L with `pad_id` (SigLIP and
HF CLIPProcessor's padding="max_length"). A spec (`to_spec()`, JSON) rebuilds the same tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILE = "tokenizer.json"
CLEANS = ("lower", "whitespace", "canonicalize")


class TokenizerError(ValueError):
    """A tokenizer that is not local or cannot be read; the message names the file it needs (CLI exit 2)."""

    exit_code = 2


def _clean_fn(clean: str):
    from open_clip.tokenizer import get_clean_fn

    return get_clean_fn(clean)


class OpenClipTokenizer:
    """open_clip.tokenizer.SimpleTokenizer (CLIP's BPE, lower-cased, <start_of_text> ... <end_of_text>)."""

    kind = "open_clip"

    def __init__(self, context_length: int = 77, clean: str = "lower", bpe_path: str | None = None) -> None:
        """`bpe_path`: a copy of the BPE vocabulary (bpe_simple_vocab_16e6.txt.gz); default the wheel's."""
        try:
            from open_clip.tokenizer import SimpleTokenizer
        except ImportError as e:
            raise TokenizerError(f"open_clip's tokenizer needs open_clip_torch ({e}); "
                                 "pip install 'vit-serve[clip]'") from None
        if clean not in CLEANS:
            raise TokenizerError(f"tokenizer clean={clean!r}; expected one of {', '.join(CLEANS)}")
        self.context_length = context_length
        self.clean = clean
        if bpe_path is not None and not Path(bpe_path).is_file():
            raise TokenizerError(f"the tokenizer's BPE vocabulary {bpe_path} is missing")
        self.bpe_path = bpe_path
        kw = {"bpe_path": str(bpe_path)} if bpe_path is not None else {}
        self._tok = SimpleTokenizer(context_length=context_length, clean=clean, **kw)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """K strings -> LongTensor [K, context_length]."""
        return self._tok(list(texts), context_length=self.context_length)

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": self.kind, "context_length": self.context_length, "clean": self.clean}
        if self.bpe_path is not None:
            spec["bpe_path"] = str(self.bpe_path)
        return spec


class HFTokenizer:
    """A Hugging Face tokenizer.json (`tokenizers.Tokenizer`), padded with `pad_id` to `context_length`.

    `clean` (optional) is open_clip's text cleaning applied first, as open_clip's HFTokenizer does
    ("canonicalize" for its SigLIP configs); None applies only the tokenizer's own normaliser (transformers).
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, context_length: int, pad_id: int, clean: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise TokenizerError(f"tokenizer.json needs the tokenizers library ({e}); "
                                 "pip install 'vit-serve[clip]'") from None
        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own Exception type
            raise TokenizerError(f"cannot read {TOKENIZER_FILE}: {' '.join(str(e).split())}") from None
        self._json = tokenizer_json
        self.context_length = context_length
        self.pad_id = pad_id
        self.clean = clean
        self._tok.no_padding()
        self._tok.enable_truncation(context_length)

    @classmethod
    def from_file(cls, path: str | Path, context_length: int, pad_id: int, clean: str | None = None) -> HFTokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"the tokenizer is not local: put its {TOKENIZER_FILE} in {path.parent} "
                                 "(nothing is downloaded)")
        return cls(path.read_text(encoding="utf-8"), context_length, pad_id, clean)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """K strings -> LongTensor [K, context_length]."""
        texts = list(texts)
        if self.clean:
            fn = _clean_fn(self.clean)
            texts = [fn(t) for t in texts]
        out = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        for i, enc in enumerate(self._tok.encode_batch(texts)):
            ids = enc.ids[: self.context_length]
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "context_length": self.context_length, "pad_id": self.pad_id,
                "clean": self.clean, "tokenizer_json": self._json}


Tokenizer = OpenClipTokenizer | HFTokenizer


def tokenizer_from_spec(spec: dict[str, Any]) -> Tokenizer:
    """The tokenizer a `to_spec()` dict describes."""
    kind = spec.get("kind")
    if kind == "open_clip":
        return OpenClipTokenizer(int(spec["context_length"]), spec.get("clean", "lower"), spec.get("bpe_path"))
    if kind == "hf":
        return HFTokenizer(spec["tokenizer_json"], int(spec["context_length"]), int(spec["pad_id"]),
                           spec.get("clean"))
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected open_clip or hf")


def spec_to_json(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)
