"""A text tower served beside an image model: `NAME_text.onnx` (input_ids int64 [B, L] -> text_embeds [B, E]) with
its manifest (`vit_serve.text.manifest.TextTowerManifest`) and tokenizer, run with onnxruntime.

`TextTower.classes(labels)` gives the labels' class embeddings [n, E] (`zero_shot.class_embeddings` of their
prompts), from an LRU cache of `cache_size` labels when it has them; the rest are tokenized and run through the
graph in one batch. It computes in the calling thread: the gateway calls it in the tower's own thread
(`executor`), off the event loop. No web framework here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vit_serve.runtime import zero_shot
from vit_serve.text.manifest import INPUT_IDS, TEXT_EMBEDS, TextTowerManifest, text_path_of


def text_tower_of(model_path: str | Path) -> Path | None:
    """`dir/NAME_text.onnx` beside a model file `dir/NAME.*` (None when there is none)."""
    path = text_path_of(model_path)
    return path if path.is_file() else None


@dataclass
class CacheStats:
    """Labels found in the cache (`hits`) and encoded (`misses`) since the tower was loaded."""

    hits: int = 0
    misses: int = 0


class LabelCache:
    """An LRU map label -> class embedding [E], at most `size` labels (0: none kept). Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, label: str) -> np.ndarray | None:
        with self._lock:
            found = self._items.get(label)
            if found is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(label)
            self.stats.hits += 1
            return found

    def put(self, label: str, value: np.ndarray) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[label] = value
            self._items.move_to_end(label)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def _tokenizer(manifest: TextTowerManifest, onnx_path: Path):
    """The tokenizer the manifest names, built from the files beside the graph (nothing downloaded)."""
    from vit_serve.text.tokenizer import HFTokenizer, OpenClipTokenizer

    spec = manifest.tokenizer
    opts = spec.options
    if spec.kind == "open_clip":
        return OpenClipTokenizer(spec.context_length, opts.get("clean", "lower"))
    (path, *_) = manifest.tokenizer_files(onnx_path)
    return HFTokenizer.from_file(path, spec.context_length, int(opts.get("pad_id", 0)), opts.get("clean"))


class TextTower:
    """The text graph, its manifest, tokenizer and label cache; `executor`: the thread it runs in."""

    def __init__(self, onnx_path: str | Path, cache_size: int = 1024, device: str = "cpu",
                 threads: int | None = None) -> None:
        import onnxruntime as ort

        from vit_serve.runtime.backends.onnxruntime import session_options, session_providers

        self.path = Path(onnx_path)
        self.manifest = TextTowerManifest.read(self.path)
        self.tokenizer = _tokenizer(self.manifest, self.path)
        opts = session_options(threads)
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=session_providers(device))
        except Exception as e:  # onnxruntime's own exception types
            raise ValueError(f"onnxruntime cannot load {self.path.name}: {' '.join(str(e).split())}") from e
        self.cache = LabelCache(cache_size)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"vit-serve-text-{self.path.stem}")

    @property
    def scores(self) -> str:
        return self.manifest.scores

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """Texts -> text_embeds [n, E] float32 (not normalised), the graph run once."""
        ids = np.asarray(self.tokenizer(texts), dtype=np.int64)
        (out,) = self.session.run([TEXT_EMBEDS], {INPUT_IDS: ids})
        return out.astype(np.float32, copy=False)

    def classes(self, labels: list[str]) -> np.ndarray:
        """Labels -> class embeddings [n, E] (normalised; each the mean of its prompts' normalised embeddings,
        renormalised), the cached ones from the cache, the others encoded together and cached."""
        found = {label: self.cache.get(label) for label in labels}
        todo = [label for label, v in found.items() if v is None]
        if todo:
            templates = self.manifest.templates
            new = zero_shot.class_embeddings(self.embed_texts(zero_shot.prompts(todo, templates)), len(templates))
            for label, row in zip(todo, new, strict=True):
                found[label] = row
                self.cache.put(label, row)
        return np.stack([found[label] for label in labels])

    def logits(self, image_embeds: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Image embeddings [B, E] -> zero-shot logits [B, n] over `classes`' labels."""
        m = self.manifest
        return zero_shot.label_logits(image_embeds, classes, m.logit_scale, m.logit_bias)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
