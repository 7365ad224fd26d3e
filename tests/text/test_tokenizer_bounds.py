"""The open_clip tokenizer on request text: its word cache is a bounded LRU (open_clip's keeps every distinct word
forever), its output stays open_clip's own (`open_clip.tokenize`) also after evictions, and text the reference
would truncate, or with a word too long for the BPE, is refused when asked to be strict."""

from __future__ import annotations

import random

import pytest
import torch

open_clip = pytest.importorskip("open_clip")


def _random_words(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(rnd.randint(1, 6))) for _ in range(n)]


def test_the_word_cache_is_bounded_and_the_ids_stay_open_clips():
    from vit_serve.text.tokenizer import WORD_CACHE_SIZE, OpenClipTokenizer

    tok = OpenClipTokenizer()
    words = _random_words(WORD_CACHE_SIZE + 2_000)
    for i in range(0, len(words), 500):
        tok(words[i:i + 500])
    cache = tok._tok.cache
    assert len(cache) <= WORD_CACHE_SIZE
    texts = ["<start_of_text> a photo of a cat.", "<end_of_text>", words[0], words[-1], "naïve café, 東京 2024!"]
    assert torch.equal(tok(texts), open_clip.tokenize(texts))  # special tokens still whole after evictions
    assert torch.equal(tok(texts, strict=True), open_clip.tokenize(texts))


def test_strict_tokenizing_refuses_what_the_reference_truncates():
    from vit_serve.text.tokenizer import MAX_WORD_BYTES, OpenClipTokenizer, TextTooLongError

    tok = OpenClipTokenizer()
    digits = "1234567890" * 8  # 80 digits: 80 tokens
    assert open_clip.tokenize([digits])[0, -1] != 0  # open_clip truncates it to 77, its end token last
    assert torch.equal(tok([digits]), open_clip.tokenize([digits]))
    with pytest.raises(TextTooLongError, match="82 tokens, over the text tower's context length of 77"):
        tok([digits], strict=True)
    assert tok.check("1234567890" * 7 + "12345") == 77  # fits: 75 + start + end
    with pytest.raises(TextTooLongError, match=f"word of {MAX_WORD_BYTES + 1} bytes"):
        tok.check("x" * (MAX_WORD_BYTES + 1))
