"""What transformers makes of a local tokenizer folder (tokenizer.json + tokenizer_config.json), without
transformers: the tokenizer.json to run with the `tokenizers` library and the side it is padded on.

transformers 5 (`AutoTokenizer.from_pretrained(folder)`, which open_clip's `HFTokenizer` calls for SigLIP 2's
Gemma tokenizer) does not run a tokenizer.json as is when `tokenizer_class` names a class with its own
pipeline: `GemmaTokenizer` rebuilds a byte-fallback BPE from the file's vocabulary and merges with the normaliser
`Replace(" ", "▁")` and the pre-tokeniser `Split(" ", merged_with_previous)`, and `Siglip2Tokenizer` puts a
`Lowercase` before that normaliser. The file's post-processor is kept (tokenizer_config.json's `add_bos_token` /
`add_eos_token` are ignored when a tokenizer.json exists), and padding goes on `padding_side`, by default the
class's: left for the Gemma classes, right otherwise. References: transformers' tokenization_gemma.py,
tokenization_siglip2.py, tokenization_utils_tokenizers.py (`convert_to_native_format`), tokenization_utils_base.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GEMMA_CLASSES = ("GemmaTokenizer", "GemmaTokenizerFast", "Siglip2Tokenizer")  # the Gemma pipeline, rebuilt
LOWERCASED_CLASSES = ("Siglip2Tokenizer",)
LEFT_PADDED_CLASSES = GEMMA_CLASSES  # their `padding_side` class attribute
PADDING_SIDES = ("left", "right")


def read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json of `folder` ({} when absent or not a JSON object)."""
    path = folder / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _gemma_pipeline(data: dict[str, Any], lowercase: bool, unk: str) -> dict[str, Any]:
    """tokenizer.json (a dict) with GemmaTokenizer's own model options, normaliser and pre-tokeniser."""
    model = data.get("model") or {}
    data["model"] = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                     "vocab": model.get("vocab", {}), "merges": model.get("merges", [])}
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    data["normalizer"] = ({"type": "Sequence", "normalizers": [{"type": "Lowercase"}, replace]} if lowercase
                          else replace)
    data["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                             "invert": False}
    return data


def as_transformers_loads(tokenizer_json: str, config: dict[str, Any]) -> tuple[str, str]:
    """(the tokenizer.json transformers runs, its padding side) for a tokenizer.json and its tokenizer_config.

    Args:
        tokenizer_json: the text of tokenizer.json.
        config: tokenizer_config.json as a dict ({} when there is none: the file runs as is, padded right).
    """
    cls = str(config.get("tokenizer_class") or "")
    side = config.get("padding_side") or ("left" if cls in LEFT_PADDED_CLASSES else "right")
    if side not in PADDING_SIDES:
        raise ValueError(f"{TOKENIZER_CONFIG_FILE} padding_side={side!r}; expected left or right")
    if cls not in GEMMA_CLASSES:
        return tokenizer_json, side
    data = json.loads(tokenizer_json)
    if (data.get("model") or {}).get("type", "BPE") != "BPE":
        raise ValueError(f"{cls} needs a BPE tokenizer.json, not {data['model'].get('type')!r}")
    unk = config.get("unk_token") or "<unk>"
    unk = unk.get("content", "<unk>") if isinstance(unk, dict) else str(unk)
    return json.dumps(_gemma_pipeline(data, cls in LOWERCASED_CLASSES, unk), ensure_ascii=False), side
