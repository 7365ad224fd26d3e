"""A Gemma-style tokenizer folder built with the `tokenizers` library (nothing downloaded): SigLIP 2's tokenizer
in miniature. A byte-fallback BPE (ids 0-4 `<pad> <eos> <bos> <unk> <mask>` as Gemma's, then the 256 byte tokens,
then merges trained on a few captions), the normaliser `Replace(" ", "▁")`, and a post-processor that ends each
text with `<eos>` (as SigLIP 2's text: no `<bos>`, `<eos>` last, padded with `<pad>`), plus a tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
CORPUS = ["a photo of a cat", "a photo of a dog", "the traffic light", "a blurry photo of the bird",
          "an origami crane", "Zebra crossing at night"]
TOKENIZER_CONFIG = {"tokenizer_class": "GemmaTokenizer", "pad_token": "<pad>", "eos_token": "<eos>",
                    "bos_token": "<bos>", "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": False,
                    "add_eos_token": True, "padding_side": "right"}


def write(folder: Path, config: dict[str, Any] | None = TOKENIZER_CONFIG, vocab_size: int = 400) -> int:
    """tokenizer.json (+ tokenizer_config.json unless `config` is None) in `folder`; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=SPECIALS + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>", pair="$A <eos> $B <eos>",
                                                       special_tokens=[("<eos>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()
