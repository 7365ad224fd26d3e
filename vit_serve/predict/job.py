"""The prediction job: `predict(PredictOptions(...))`, what `vit-serve predict` runs, and its local engine.

MODEL is anything `vit-serve serve` takes (a checkpoint, an exported NAME.onnx with NAME.json, an engine, or a
repository folder with `model_name` picking one, at its newest version); it is loaded by the runtime
(`vit_serve.runtime.load`), images are decoded by the runtime's functions (`vit_serve.runtime.decode`) on the same
decode path as the gateway (`decode`, "fast" by default), and the top-k come from `vit_serve.runtime.postprocess`:
a row's scores are those `/classify` answers for the same file. One batch's pieces (decode, compute, rows, the
sink) are `vit_serve.predict.batch`'s, shared with the Ray engine.

SRC (`list_images`): a folder (recursive), a glob, a text file of paths (one a line, relative ones from the file's
folder), one image, or with `image_folder` an ImageFolder root (`root/<class>/...`, `vit_serve.data.ImageFolder`),
whose rows also carry `target` (the folder name) and `target_index` (its index among the sorted class folders).

Engines: "local" (`vit_serve.predict.local`: decode worker threads or processes, `workers`, overlapped with the
model, batched by the gateway's scheduler) and "ray" (`vit_serve.predict.ray`: Ray Data, one model actor per GPU or
per CPU). Both write through `vit_serve.predict.writers` (formats, resume, manifest, errors, rollout maps).
Importing this module imports neither Ray nor the gateway (nor does running it).
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit_serve.data import IMAGE_EXTENSIONS
from vit_serve.manifest import EMBEDDING_FINGERPRINT
from vit_serve.predict.batch import Item, Sink, load_backend
from vit_serve.predict.local import run_local
from vit_serve.predict.options import PredictOptions
from vit_serve.predict.writers import ErrorLog, RolloutFile, check_manifest, open_writer, sidecar, write_manifest

if TYPE_CHECKING:
    from vit_serve.runtime.backends.base import ModelInfo
    from vit_serve.runtime.discovery import VersionSource

GLOB_CHARS = frozenset("*?[")
ASCII_SPACE = " \t\r\f\v"  # what a line of a path list is stripped of (not U+0085, U+2028: they may be in names)


@dataclass
class PredictResult:
    """What a run did: rows written now, rows found done (skipped), files it could not read, the time taken."""

    out: Path
    total: int
    written: int
    skipped: int
    errors: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    rows: int = 0  # rows in OUT now
    # Rows per second after the first batch was written (the pipeline filled, as a load test leaves its warm-up
    # requests out of its rate); 0 with a single batch.
    steady_images_per_s: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0

    @property
    def nothing_readable(self) -> bool:
        """This run tried files, every one failed, and OUT has no rows: the one failure that exits 1."""
        return bool(self.errors) and self.written == 0 and self.rows == 0


# ---- SRC -------------------------------------------------------------------------------------------------------

def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not Path(name).name.startswith(".")


def _walk(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        yield from (os.path.join(dirpath, f) for f in sorted(filenames) if _is_image(f))


def list_images(src: str, image_folder: bool = False) -> list[Item]:
    """SRC -> the images to predict, in a deterministic order, each path once. ValueError when there are none."""
    path = Path(src)
    if image_folder:
        from vit_serve.data import ImageFolder

        ds = ImageFolder(path)  # DataError (a ValueError) naming the problem
        items = [Item(p, ds.classes[t], t) for p, t in ds.samples]
    elif path.is_dir():
        items = [Item(p) for p in _walk(path)]
    elif path.is_file() and _is_image(path.name):
        items = [Item(src)]
    elif path.is_file():
        try:
            # one path a line, lines ending at "\n" (and "\r\n") only: U+2028, U+0085 and the like may be in a name
            lines = path.read_bytes().decode("utf-8").split("\n")
        except UnicodeDecodeError:
            raise ValueError(f"{src}: neither an image nor a text file of image paths") from None
        base = path.parent
        items = [Item(ln if os.path.isabs(ln) else str(base / ln))
                 for ln in (raw.strip(ASCII_SPACE) for raw in lines) if ln and not ln.startswith("#")]
    elif GLOB_CHARS & set(src):
        items = [Item(p) for p in sorted(glob.glob(src, recursive=True)) if os.path.isfile(p) and _is_image(p)]
    else:
        raise FileNotFoundError(f"no such file or folder: {src}")
    seen: set[str] = set()
    items = [i for i in items if not (i.path in seen or seen.add(i.path))]
    if not items:
        raise ValueError(f"{src}: no images found (looked for {', '.join(e[1:] for e in IMAGE_EXTENSIONS)})")
    return items


# ---- the model -------------------------------------------------------------------------------------------------

def resolve_model(model: str, name: str | None = None) -> VersionSource:
    """MODEL (a model, or a repository folder as `vit-serve serve` reads it) -> the version to load: `name`'s
    (or the only model's) newest version."""
    from vit_serve.runtime.discovery import scan

    entries = scan(model)
    if name is not None and entries.get(name) is not None and entries[name].skipped:
        raise ValueError(f"--model {name}: {entries[name].error}")
    entries = {n: e for n, e in entries.items() if not e.skipped}  # Triton's own models, listed by `serve`
    if name is not None and name not in entries:
        raise ValueError(f"--model {name}: not in {model} (it has {', '.join(sorted(entries)) or 'no model'})")
    if name is None:
        if len(entries) != 1:
            raise ValueError(f"{model} holds {len(entries)} models ({', '.join(sorted(entries)) or 'none'}); "
                             f"pick one with --model NAME")
        name = next(iter(entries))
    entry = entries[name]
    if entry.error or not entry.versions:
        why = entry.error or "; ".join(entry.broken.values()) or "no version"
        raise ValueError(f"model {name} of {model} cannot be loaded: {why}")
    return entry.versions[max(entry.versions)]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_digest(source: VersionSource) -> str:
    """What the manifest keys on: the sha256 of the model file; of a checkpoint folder (or the folder a hub id
    downloads to), the sha256 of its model files' names and sha256s (`folder_model_files`): touching or copying
    the folder keeps it, new weights change it, whatever their times."""
    path = source.path
    if not path.exists():
        from vit_serve.checkpoints.hub import download, parse_hub_id

        repo = parse_hub_id(str(path))
        if repo is None:
            raise FileNotFoundError(f"no such file or folder: {path}")
        path = download(repo)  # the loader finds it in the cache
    if path.is_file():
        return _file_sha256(path)
    h = hashlib.sha256()
    for f in folder_model_files(path):
        h.update(f"{f.name}\0{_file_sha256(f)}\0".encode())
    return h.hexdigest()


def folder_model_files(folder: Path) -> list[Path]:
    """The files a checkpoint folder's model is made of: its JSON configs and its weights (not a README)."""
    from vit_serve.runtime.discovery import CHECKPOINT_SUFFIXES

    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.suffix.lower() in (".json", *CHECKPOINT_SUFFIXES))


def check_outputs(info: ModelInfo, opts: PredictOptions) -> None:
    """One line before any work when the model cannot give what was asked for."""
    if opts.embeddings and not info.embedding_dim:
        raise ValueError(f"--embeddings: the model {info.name!r} has no embedding output (re-export it with its "
                         f"embedding, or predict with its checkpoint)")
    if opts.max_patches is not None:
        from vit_serve.naflex import check_budget  # torch: a NaFlex run has loaded it already

        if info.max_patches is None and info.backend != "torch":
            raise ValueError(f"--max-patches: the model {info.name!r} on {info.backend} has no NaFlex graph (a "
                             f"NaFlex checkpoint runs on torch; its export with vit-export --naflex on onnxruntime)")
        try:
            check_budget(opts.max_patches, info.max_patches)
        except ValueError as e:
            raise ValueError(f"--max-patches {opts.max_patches}: {e}") from None
    if opts.explain:
        if not info.explain:
            raise ValueError(f"--explain: the model {info.name!r} has no explain graph (vit-export writes "
                             f"NAME_explain.onnx beside NAME.onnx; a checkpoint always has one)")
        info.resolve_rollout()


def columns_of(opts: PredictOptions, ood: bool = False) -> tuple[str, ...]:
    """The optional columns of a run's rows (`ood`: the model carries a reference; "ood" stands for ood_score and
    ood_flag)."""
    return tuple(c for c, on in (("target", opts.image_folder), ("embedding", opts.embeddings),
                                 (EMBEDDING_FINGERPRINT, opts.embeddings), ("rollout_index", opts.explain),
                                 ("ood", ood)) if on)


def manifest_key(source: VersionSource, digest: str, opts: PredictOptions) -> dict[str, Any]:
    """What must match for a rerun to append to OUT."""
    return {"model": source.name, "version": source.version, "model_sha256": digest, "top_k": opts.top_k,
            "decode": opts.decode, "columns": list(columns_of(opts)), "normalize": opts.normalize,
            "max_pixels": opts.max_pixels, **({"tome": opts.tome} if opts.tome is not None else {}),
            **({"max_patches": opts.max_patches} if opts.max_patches is not None else {})}


# ---- the run ---------------------------------------------------------------------------------------------------

def _progress(total: int, done: int, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="img", disable=quiet, dynamic_ncols=True, smoothing=0.1,
                desc="predict")


def predict(opts: PredictOptions) -> PredictResult:
    """Run the job: list SRC, check OUT (resume or refuse), load the model, predict what is not yet written."""
    out = Path(opts.out)
    source = resolve_model(opts.model, opts.model_name)
    if opts.task == "embed-text":
        from vit_serve.predict.texts import predict_texts

        rows, seconds = predict_texts(source, opts, model_digest(source))
        return PredictResult(out, rows, rows, 0, [], seconds, rows)
    items = list_images(opts.src, opts.image_folder)
    key = manifest_key(source, model_digest(source), opts)
    check_manifest(out, key, opts.force)
    if opts.engine == "ray":
        from vit_serve.predict.ray import require_ray

        require_ray()  # before the model is loaded here: one line naming the extra
    backend = load_backend(source, opts)
    info = backend.info
    check_outputs(info, opts)
    writer = open_writer(out, opts.top_k, columns_of(opts, info.reference is not None), opts.part_rows)
    about = {"model_path": str(source.path), "backend": info.backend, "resolution": list(info.resolution),
             "preprocess": asdict(info.preprocess), "engine": opts.engine,
             "rollout": asdict(info.resolve_rollout()) if opts.explain else None,
             "labels": [info.label(i) for i in range(info.num_classes)],
             **({EMBEDDING_FINGERPRINT: info.embedding_fingerprint(opts.normalize)} if opts.embeddings else {})}
    write_manifest(out, key, about)
    rollout = RolloutFile(sidecar(out, "rollout.npy"), info.grid) if opts.explain else None
    errors = ErrorLog(sidecar(out, "errors.jsonl"))
    todo = [i for i in items if i.path not in writer.done]
    skipped = len(items) - len(todo)
    bar = _progress(len(items), skipped, opts.quiet)
    sink = Sink(writer, rollout, errors, bar, info, opts)
    t0 = time.perf_counter()
    try:
        unkeyable = {i.path: why for i in todo if (why := writer.key_problem(i.path))}
        for path, why in unkeyable.items():  # listed, never decoded: the run goes on without them
            sink.error(path, why)
        todo = [i for i in todo if i.path not in unkeyable]
        if todo and opts.engine == "ray":
            from vit_serve.predict.ray import run_ray

            backend.close()  # the actors load their own
            run_ray(source, todo, sink, opts)
        elif todo:
            from vit_serve.runtime.settings import available_cpus, default_decode_workers

            workers = opts.workers or default_decode_workers(available_cpus(), opts.threads, info.device)
            backend.warmup()
            t0 = time.perf_counter()
            run_local(backend, todo, sink, opts, workers)
    finally:
        writer.close()
        bar.close()
        errors.close()
        if rollout is not None:
            rollout.close()
    end = time.perf_counter()
    steady = 0.0
    if sink.first is not None and sink.written > sink.first[1] and end > sink.first[0]:
        steady = (sink.written - sink.first[1]) / (end - sink.first[0])
    return PredictResult(out, len(items), sink.written, skipped, errors.errors, end - t0, writer.rows, steady)
