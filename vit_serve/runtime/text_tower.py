"""A text tower served beside an image model: `NAME_text.onnx` (input_ids int64 [B, L] -> text_embeds [B, E]) with
its manifest (`vit_serve.text.manifest.TextTowerManifest`) and tokenizer, run with onnxruntime; or, for a checkpoint
the torch backend serves, the text tower stored in it (`vit-serve convert` of a CLIP / SigLIP checkpoint keeps it),
run with torch (`TextTower.from_checkpoint`).

A request's labels (`TextTower.check_labels` first, where the request is parsed) become class embeddings [n, E]
(`vit_serve.zeroshot.class_embeddings` of their prompts) in two steps: `plan(scope, labels)` takes the labels the
caller's scope has in the LRU cache (`LabelCache`: keyed by scope and label, so that one caller never meets another's
cache hit) and says how many prompts the others need (`TextJob.prompts`: what the gateway charges to the key's
rate); `submit(job, ...)` hands the job to the tower's own thread (`TextScheduler`), which encodes its prompts
`chunk_size` at a time (peak memory is that of one chunk, whatever labels x templates is), the most urgent job's
chunk first and jobs of one level in turn, at most `queue_size` jobs held (`QueueFullError` beyond); before each
chunk a job whose future was cancelled (its client hung up) is dropped and one past its deadline fails
(`ModelTimeoutError`). No web framework here.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vit_serve import zeroshot
from vit_serve.runtime import zero_shot
from vit_serve.runtime.errors import ModelTimeoutError, QueueFullError
from vit_serve.text.manifest import INPUT_IDS, TEXT_EMBEDS, TextTowerManifest, text_path_of

SHARED_SCOPE = ""  # the cache scope of callers without keys


def text_tower_of(model_path: str | Path) -> Path | None:
    """`dir/NAME_text.onnx` beside a model file `dir/NAME.*` (None when there is none)."""
    path = text_path_of(model_path)
    return path if path.is_file() else None


def holds_text_tower(checkpoint: str | Path) -> bool:
    """Whether a checkpoint file (safetensors) stores a text tower, read from its metadata alone."""
    from safetensors import safe_open

    from vit_serve.text.bundle import META_CONFIG

    path = Path(checkpoint)
    if path.suffix.lower() != ".safetensors" or not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return META_CONFIG in (f.metadata() or {})
    except Exception:  # not a safetensors file after all: the image model's loader says why
        return False


@dataclass
class CacheStats:
    """Labels found in the cache (`hits`) and encoded (`misses`) since the tower was loaded."""

    hits: int = 0
    misses: int = 0


class LabelCache:
    """An LRU map (scope, label) -> class embedding [E], at most `size` entries (0: none kept). Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, label: str, scope: str = SHARED_SCOPE) -> np.ndarray | None:
        key = (scope, label)
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return found

    def put(self, label: str, value: np.ndarray, scope: str = SHARED_SCOPE) -> None:
        if self.size <= 0:
            return
        key = (scope, label)
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(eq=False)
class TextJob:
    """One request's labels: those its scope had cached (`found`), those to encode (`todo`), the cache hits and
    misses it met, and the prompts it needs the graph for (`prompts`: todo x templates)."""

    scope: str
    labels: list[str]
    found: dict[str, np.ndarray]
    todo: list[str]
    prompts: int
    hits: int = 0
    misses: int = 0


@dataclass(order=True)
class _Queued:
    """A job in the scheduler's heap: its level (1 first), then its turn (round-robin within a level)."""

    priority: int
    turn: int
    deadline: float | None = field(compare=False)  # time.perf_counter() seconds
    steps: Iterator[None] = field(compare=False)  # one chunk per next(); StopIteration(value): the result
    future: concurrent.futures.Future = field(compare=False)


class TextScheduler:
    """One thread that runs the text jobs a chunk at a time, the most urgent first and a level's jobs in turn,
    holding at most `queue_size` jobs (waiting or running)."""

    def __init__(self, name: str, queue_size: int) -> None:
        self.queue_size = queue_size
        self._heap: list[_Queued] = []
        self._held = 0
        self._turns = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def held(self) -> int:
        """Jobs waiting or running."""
        return self._held

    @property
    def waiting(self) -> int:
        """Jobs waiting for their next chunk (not the one running)."""
        return len(self._heap)

    def submit(self, steps: Iterator[None], priority: int = 1, deadline: float | None = None
               ) -> concurrent.futures.Future:
        """Queue a job (`steps`: a generator that runs a chunk per step and returns its result); QueueFullError
        when `queue_size` jobs are held. Cancel the future to drop the job before its next chunk."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise QueueFullError("the text tower is closed", retry_after="1")
            if self._held >= self.queue_size:
                raise QueueFullError(f"the text tower's queue is full ({self.queue_size} requests with labels; "
                                     f"VIT_SERVE_TEXT_QUEUE_SIZE): retry later", retry_after="1")
            self._held += 1
            heapq.heappush(self._heap, _Queued(priority, next(self._turns), deadline, steps, future))
            self._cond.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = heapq.heappop(self._heap)
            more = self._step(job)
            with self._cond:
                if more and not self._closed:
                    job.turn = next(self._turns)
                    heapq.heappush(self._heap, job)
                    continue
                self._held -= 1
            if more:  # closed meanwhile
                job.future.cancel()
                job.steps.close()

    def _step(self, job: _Queued) -> bool:
        """Run one chunk of `job`: True when it has more."""
        if job.future.cancelled():  # its client went away: the chunks not run are skipped
            job.steps.close()
            return False
        late = None if job.deadline is None else time.perf_counter() - job.deadline
        if late is not None and late >= 0:
            job.steps.close()
            self._finish(job, error=ModelTimeoutError(f"the request's deadline passed while its labels were encoded "
                                                      f"({late * 1e3:.0f} ms ago)"))
            return False
        try:
            next(job.steps)
        except StopIteration as done:
            self._finish(job, result=done.value)
            return False
        except Exception as e:  # handed to the request that waits for it
            self._finish(job, error=e)
            return False
        return True

    @staticmethod
    def _finish(job: _Queued, result: object = None, error: BaseException | None = None) -> None:
        if not job.future.set_running_or_notify_cancel():  # cancelled meanwhile: nobody waits
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def close(self) -> None:
        """Stop the thread; jobs still held are cancelled."""
        with self._cond:
            self._closed = True
            left, self._heap = self._heap, []
            self._cond.notify_all()
        for job in left:
            job.future.cancel()
            job.steps.close()


def _tokenizer(manifest: TextTowerManifest, onnx_path: Path):
    """The tokenizer the manifest names, built from the files beside the graph (nothing downloaded)."""
    from vit_serve.text.tokenizer import HFTokenizer, OpenClipTokenizer

    spec = manifest.tokenizer
    opts = spec.options
    if spec.kind == "open_clip":
        return OpenClipTokenizer(spec.context_length, opts.get("clean", "lower"))
    (path, *_) = manifest.tokenizer_files(onnx_path)
    return HFTokenizer.from_file(path, spec.context_length, int(opts.get("pad_id", 0)), opts.get("clean"),
                                 opts.get("padding_side", "right"))


class TextTower:
    """The text graph, its manifest, tokenizer, label cache and scheduler (`limits`: the gateway's cache size,
    chunk size and queue size)."""

    def __init__(self, onnx_path: str | Path, cache_size: int | None = None, device: str = "cpu",
                 threads: int | None = None, limits: zero_shot.LabelLimits | None = None,
                 runtime: str = "onnxruntime") -> None:
        self.path = Path(onnx_path)
        manifest = TextTowerManifest.read(self.path)
        if runtime == "openvino":  # beside an image model on OpenVINO (`runtime.backends.openvino.GraphSession`)
            from vit_serve.runtime.backends.openvino import GraphSession

            self.session = GraphSession(self.path, threads)
        else:
            import onnxruntime as ort

            from vit_serve.runtime.backends.onnxruntime import session_options, session_providers

            try:
                self.session = ort.InferenceSession(str(self.path), session_options(threads),
                                                    providers=session_providers(device))
            except Exception as e:  # onnxruntime's own exception types
                raise ValueError(f"onnxruntime cannot load {self.path.name}: {' '.join(str(e).split())}") from e
        self._setup(manifest, _tokenizer(manifest, self.path), cache_size, limits)

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, cache_size: int | None = None, device: str = "cpu",
                        limits: zero_shot.LabelLimits | None = None) -> TextTower:
        """The text tower stored in a checkpoint, run with torch on `device`: the tokenizer, logit scale and bias
        and templates it was converted with, as `vit-export --text-tower` would write them into the manifest."""
        import torch

        from vit_serve.checkpoints.io import read_weights
        from vit_serve.text.bundle import bundle_from_checkpoint
        from vit_serve.text.manifest import DEFAULT_TEMPLATES, TokenizerSpec

        tower = cls.__new__(cls)
        tower.path = Path(checkpoint)
        bundle = bundle_from_checkpoint(*read_weights(tower.path), str(tower.path))
        if bundle is None:
            raise ValueError(f"{tower.path.name} holds no text tower")
        net = bundle.tower.to(device).eval()
        manifest = TextTowerManifest(
            tokenizer=TokenizerSpec(bundle.tokenizer.kind, (tower.path.name,), bundle.config.context_length),
            embedding_dim=bundle.config.embed_dim, logit_scale=bundle.logit_scale, logit_bias=bundle.logit_bias,
            scores="sigmoid" if bundle.sigmoid else "softmax", templates=bundle.templates or DEFAULT_TEMPLATES,
            source_checkpoint=str(tower.path))

        @torch.inference_mode()
        def encode(ids: np.ndarray) -> np.ndarray:
            return net(torch.from_numpy(ids).to(device)).float().cpu().numpy()

        tower._encode = encode  # type: ignore[method-assign]  # the torch tower instead of the graph
        tower._setup(manifest, bundle.tokenizer, cache_size, limits)
        return tower

    def _setup(self, manifest: TextTowerManifest, tokenizer, cache_size: int | None,
               limits: zero_shot.LabelLimits | None) -> None:
        self.limits = limits or zero_shot.LabelLimits()
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.cache = LabelCache(self.limits.cache_size if cache_size is None else cache_size)
        self.chunk_size = self.limits.chunk_size
        self.scheduler = TextScheduler(f"vit-serve-text-{self.path.stem}", self.limits.queue_size)
        self._template_tokens = self._longest_template()

    @property
    def scores(self) -> str:
        return self.manifest.scores

    @property
    def templates(self) -> tuple[str, ...]:
        return self.manifest.templates

    def _longest_template(self) -> int:
        """The most tokens a template adds to a label (its own words, without the start and end tokens)."""
        return max(self.tokenizer.check(t.replace("{}", "")) for t in self.templates) - 2

    # ---- a request's labels ------------------------------------------------------------------------------

    def check_labels(self, labels: list[str]) -> None:
        """ValueError for a label whose prompts would not fit the context length (the reference tokenizer would
        truncate them) or with a word too long for the BPE (`tokenizer.MAX_WORD_BYTES`); the request's labels
        x templates within `max_label_prompts`."""
        from vit_serve.text.tokenizer import TextTooLongError

        n = len(labels) * len(self.templates)
        if n > self.limits.max_label_prompts:
            raise ValueError(f"{len(labels)} labels x {len(self.templates)} templates = {n} prompts, over the limit "
                             f"of {self.limits.max_label_prompts} ({zero_shot.MAX_LABEL_PROMPTS_SETTING})")
        ctx = self.tokenizer.context_length
        for label in labels:
            try:
                tokens = self.tokenizer.check(label)
            except TextTooLongError as e:
                raise ValueError(f"label {e}") from None
            if tokens + self._template_tokens > ctx:
                raise ValueError(f"label {label[:24]!r}... is {tokens - 2} tokens and the longest template adds "
                                 f"{self._template_tokens}: over the text tower's context length of {ctx} (with its "
                                 f"start and end tokens)")

    def plan(self, labels: list[str], scope: str = SHARED_SCOPE) -> TextJob:
        """The labels `scope` has cached, and the prompts the others need."""
        found: dict[str, np.ndarray] = {}
        for label in labels:
            hit = self.cache.get(label, scope)
            if hit is not None:
                found[label] = hit
        todo = [label for label in labels if label not in found]
        return TextJob(scope, labels, found, todo, len(todo) * len(self.templates), len(found), len(todo))

    def submit(self, job: TextJob, priority: int = 1, deadline: float | None = None) -> concurrent.futures.Future:
        """Encode `job`'s labels in the tower's thread: a future of its class embeddings [n, E] (cached under its
        scope as they are made); QueueFullError when the queue is full."""
        return self.scheduler.submit(self._steps(job), priority, deadline)

    def _chunks(self, texts: list[str]) -> Generator[None, None, np.ndarray | None]:
        """Encode `texts` `chunk_size` at a time, yielding between chunks (the scheduler's turn); returns their
        text_embeds [n, E] (None for no texts)."""
        embeds: np.ndarray | None = None
        for start in range(0, len(texts), self.chunk_size):
            chunk = self.embed_texts(texts[start:start + self.chunk_size], strict=True)
            if embeds is None:
                embeds = np.empty((len(texts), chunk.shape[1]), np.float32)
            embeds[start:start + len(chunk)] = chunk
            if start + self.chunk_size < len(texts):
                yield
        return embeds

    def _steps(self, job: TextJob) -> Iterator[None]:
        templates = self.templates
        embeds = yield from self._chunks(zeroshot.prompts(job.todo, templates))
        found = dict(job.found)
        if embeds is not None:
            for label, row in zip(job.todo, zeroshot.class_embeddings(embeds, len(templates)), strict=True):
                found[label] = row
                self.cache.put(label, row, job.scope)
        return np.stack([found[label] for label in job.labels])

    def submit_texts(self, texts: list[str], priority: int = 1, deadline: float | None = None
                     ) -> concurrent.futures.Future:
        """Encode `texts` themselves (no templates, not cached: POST /v1/embeddings) in the tower's thread, a
        chunk at a time as a request's labels: a future of text_embeds [n, E] float32 (not normalised; TextTooLongError
        for a text over the context length); QueueFullError when the queue is full."""
        return self.scheduler.submit(self._text_steps(list(texts)), priority, deadline)

    def _text_steps(self, texts: list[str]) -> Iterator[None]:
        embeds = yield from self._chunks(texts)
        assert embeds is not None
        return embeds

    def count_tokens(self, text: str) -> int:
        """The tokens `text` is (its start and end tokens included); TextTooLongError beyond the context length or
        for a word too long for the BPE."""
        return self.tokenizer.check(text)

    def _encode(self, ids: np.ndarray) -> np.ndarray:
        """input_ids [n, L] -> text_embeds [n, E]: the ONNX graph (a checkpoint's tower replaces this)."""
        return self.session.run([TEXT_EMBEDS], {INPUT_IDS: ids})[0]

    def embed_texts(self, texts: list[str], strict: bool = False) -> np.ndarray:
        """Texts -> text_embeds [n, E] float32 (not normalised), the graph run once (`strict`: TextTooLongError
        for a text that does not fit the context length, rather than truncating it)."""
        ids = np.asarray(self.tokenizer(texts, strict=strict), dtype=np.int64)
        return self._encode(ids).astype(np.float32, copy=False)

    def classes(self, labels: list[str], scope: str = SHARED_SCOPE) -> np.ndarray:
        """Labels -> class embeddings [n, E] (normalised; each the mean of its prompts' normalised embeddings,
        renormalised), the cached ones from the cache, the others encoded a chunk at a time and cached; waits for
        the tower's thread."""
        job = self.plan(labels, scope)
        if not job.todo:
            return np.stack([job.found[label] for label in labels])
        return self.submit(job).result()

    def logits(self, image_embeds: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Image embeddings [B, E] -> zero-shot logits [B, n] over `classes`' labels."""
        m = self.manifest
        return zeroshot.label_logits(image_embeds, classes, m.logit_scale, m.logit_bias)

    def close(self) -> None:
        self.scheduler.close()
