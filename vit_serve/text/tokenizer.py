"""Tokenizers for the text towers, nothing downloaded: open_clip's SimpleTokenizer (the BPE vocabulary ships in
the open_clip wheel) and a Hugging Face `tokenizer.json` read with the `tokenizers` library.

Both turn a list of K strings into ids [K, L] (L = the tower's context length), padded and truncated as the
reference does: open_clip's SimpleTokenizer.__call__ (zeros after the end-of-text token, truncation keeps it
last), and for tokenizer.json the tokenizer's own post-processor, padded to L with `pad_id` (SigLIP and
HF CLIPProcessor's padding="max_length"). A spec (`to_spec()`, JSON) rebuilds the same tokenizer.

Text from requests (`strict=True`, `check`): a text that does not fit the context length is refused
(`TextTooLongError`) where the reference truncates it, and a word of more than `MAX_WORD_BYTES` UTF-8 bytes is
refused before its BPE (the BPE's work grows with the square of a word's length). open_clip's word cache, which
keeps every distinct word forever, is a bounded LRU here (`WordCache`, `WORD_CACHE_SIZE` words).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILE = "tokenizer.json"
CLEANS = ("lower", "whitespace", "canonicalize")
WORD_CACHE_SIZE = 10_000  # distinct words whose BPE open_clip's tokenizer keeps (a few MB at most)
MAX_WORD_BYTES = 96  # longest word (UTF-8 bytes: BPE symbols) a request's text may hold: 32 CJK characters


class TokenizerError(ValueError):
    """A tokenizer that is not local or cannot be read; the message names the file it needs (CLI exit 2)."""

    exit_code = 2


class TextTooLongError(ValueError):
    """A request's text that the tokenizer would truncate, or with a word too long for the BPE (`MAX_WORD_BYTES`)."""


class WordCache(OrderedDict):
    """open_clip SimpleTokenizer's `cache` (word -> its BPE), bounded: the `size` words used last, and the special
    tokens it starts with always (evicted, they would be split by the BPE). Used under the tokenizer's lock."""

    def __init__(self, pinned: dict[str, str], size: int = WORD_CACHE_SIZE) -> None:
        super().__init__()
        self.pinned, self.size = dict(pinned), size

    def __contains__(self, word: object) -> bool:
        return word in self.pinned or super().__contains__(word)

    def __getitem__(self, word: str) -> str:
        if word in self.pinned:
            return self.pinned[word]
        self.move_to_end(word)
        return super().__getitem__(word)

    def __setitem__(self, word: str, bpe: str) -> None:
        super().__setitem__(word, bpe)
        self.move_to_end(word)
        while len(self) > self.size:
            self.popitem(last=False)


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
        self._tok.cache = WordCache(self._tok.cache)
        self._lock = threading.Lock()  # the word cache is shared by the threads that tokenize

    def words(self, text: str) -> list[str]:
        """The words the BPE runs on, one by one (open_clip's cleaning and split)."""
        return self._tok.pat.findall(self._tok.clean_fn(text))

    def check(self, text: str) -> int:
        """The tokens of `text` with its start and end tokens (TextTooLongError beyond the context length, or for
        a word of more than MAX_WORD_BYTES bytes, which the BPE never sees)."""
        return len(self._ids(text))

    def _ids(self, text: str) -> list[int]:
        tok = self._tok
        long = next((w for w in self.words(text) if len(w.encode("utf-8")) > MAX_WORD_BYTES), None)
        if long is not None:
            raise TextTooLongError(f"{text[:24]!r}... has a word of {len(long.encode('utf-8'))} bytes, over the "
                                   f"tokenizer's limit of {MAX_WORD_BYTES}")
        with self._lock:
            ids = [tok.sot_token_id, *tok.encode(text), tok.eot_token_id]
        if len(ids) > self.context_length:
            raise TextTooLongError(f"{text[:24]!r}... is {len(ids)} tokens, over the text tower's context length of "
                                   f"{self.context_length}")
        return ids

    def __call__(self, texts: Sequence[str], strict: bool = False) -> torch.Tensor:
        """K strings -> LongTensor [K, context_length]; `strict`: TextTooLongError for a text the reference would
        truncate (`check`), else truncated as open_clip's SimpleTokenizer does."""
        if not strict:
            with self._lock:
                return self._tok(list(texts), context_length=self.context_length)
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = self._ids(text)
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"kind": self.kind, "context_length": self.context_length, "clean": self.clean}
        if self.bpe_path is not None:
            spec["bpe_path"] = str(self.bpe_path)
        return spec


class HFTokenizer:
    """A Hugging Face tokenizer.json (`tokenizers.Tokenizer`), padded with `pad_id` to `context_length`.

    `clean` (optional) is open_clip's text cleaning applied first, as open_clip's HFTokenizer does
    ("canonicalize" for its SigLIP configs); None applies only the tokenizer's own normaliser (transformers).
    `padding_side` "left" puts the pads first (transformers' default for the Gemma tokenizers of SigLIP 2,
    `tokenizer_config.as_transformers_loads`).
    """

    kind = "hf"

    def __init__(self, tokenizer_json: str, context_length: int, pad_id: int, clean: str | None = None,
                 padding_side: str = "right") -> None:
        if padding_side not in ("left", "right"):
            raise TokenizerError(f"tokenizer padding_side={padding_side!r}; expected left or right")
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
        self.padding_side = padding_side
        self._tok.no_padding()
        self._tok.enable_truncation(context_length)

    @classmethod
    def from_file(cls, path: str | Path, context_length: int, pad_id: int, clean: str | None = None,
                  padding_side: str = "right") -> HFTokenizer:
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"the tokenizer is not local: put its {TOKENIZER_FILE} in {path.parent} "
                                 "(nothing is downloaded)")
        return cls(path.read_text(encoding="utf-8"), context_length, pad_id, clean, padding_side)

    def check(self, text: str) -> int:
        """The tokens of `text` (TextTooLongError beyond the context length or for a word of more than
        MAX_WORD_BYTES bytes)."""
        self([text], strict=True)
        return len(self._tok.encode(self._clean(text)).ids)

    def _clean(self, text: str) -> str:
        return _clean_fn(self.clean)(text) if self.clean else text

    def __call__(self, texts: Sequence[str], strict: bool = False) -> torch.Tensor:
        """K strings -> LongTensor [K, context_length]; `strict`: TextTooLongError for a text the tokenizer would
        truncate, else truncated as its post-processor does."""
        texts = [self._clean(t) for t in texts]
        if strict:
            long = next((w for t in texts for w in t.split() if len(w.encode("utf-8")) > MAX_WORD_BYTES), None)
            if long is not None:
                raise TextTooLongError(f"{long[:24]!r}... is a word of {len(long.encode('utf-8'))} bytes, over the "
                                       f"tokenizer's limit of {MAX_WORD_BYTES}")
        out = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        for i, (text, enc) in enumerate(zip(texts, self._tok.encode_batch(texts), strict=True)):
            if strict and enc.overflowing:
                n = len(enc.ids) + sum(len(o.ids) for o in enc.overflowing)
                raise TextTooLongError(f"{text[:24]!r}... is about {n} tokens, over the text tower's context length "
                                       f"of {self.context_length}")
            ids = torch.tensor(enc.ids[: self.context_length], dtype=torch.long)
            if self.padding_side == "left":
                out[i, self.context_length - len(ids):] = ids
            else:
                out[i, : len(ids)] = ids
        return out

    def to_spec(self) -> dict[str, Any]:
        spec = {"kind": self.kind, "context_length": self.context_length, "pad_id": self.pad_id,
                "clean": self.clean, "tokenizer_json": self._json}
        if self.padding_side != "right":  # specs written before the option read as right-padded
            spec["padding_side"] = self.padding_side
        return spec


Tokenizer = OpenClipTokenizer | HFTokenizer


def tokenizer_from_spec(spec: dict[str, Any]) -> Tokenizer:
    """The tokenizer a `to_spec()` dict describes."""
    kind = spec.get("kind")
    if kind == "open_clip":
        return OpenClipTokenizer(int(spec["context_length"]), spec.get("clean", "lower"), spec.get("bpe_path"))
    if kind == "hf":
        return HFTokenizer(spec["tokenizer_json"], int(spec["context_length"]), int(spec["pad_id"]),
                           spec.get("clean"), spec.get("padding_side", "right"))
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected open_clip or hf")


def spec_to_json(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)
