"""One batch of `vit-serve predict`, whichever engine runs it: an image to predict (`Item`), the model loaded on the
runtime (`load_backend`), a file decoded as the gateway decodes an upload (`decode_file`), the model's outputs
(`compute`), the rows made of them (`make_rows`) and where they go (`Sink`).

Both engines stand on this module: `vit_serve.predict.job` (the job, and the local engine) and `vit_serve.predict.ray`
(Ray Data's model actors). Nothing here imports either, nor the HTTP gateway, nor Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vit_serve.manifest import EMBEDDING_FINGERPRINT
from vit_serve.predict.options import PredictOptions
from vit_serve.predict.writers import ErrorLog, RolloutFile, Row, printable
from vit_serve.tome_schedule import parse_tome

if TYPE_CHECKING:
    from vit_serve.preprocess import PreprocessConfig
    from vit_serve.runtime.backends.base import LocalBackend, ModelInfo
    from vit_serve.runtime.discovery import VersionSource
    from vit_serve.runtime.task import Outputs, Task


@dataclass(frozen=True)
class Item:
    """One image to predict: its path as SRC lists it (the row's key), and its ImageFolder class if any."""

    path: str
    target: str | None = None
    target_index: int | None = None


def load_backend(source: VersionSource, opts: PredictOptions) -> LocalBackend:
    """The runtime's backend for `source`, on `opts.device`, decoding as `opts.decode` says (as the gateway;
    "contract": as the model's own preprocessing contract says, the runtime's None)."""
    from vit_serve.runtime import LoadSpec, load
    from vit_serve.runtime.backends.base import LocalBackend

    runtime = source.backend
    if opts.backend != "auto":
        if source.backend not in ("onnxruntime", "openvino"):
            raise ValueError(f"--backend {opts.backend} runs exports (NAME.onnx, NAME.xml), not {source.path.name}")
        runtime = opts.backend  # an export runs on either
    backend = load(LoadSpec(path=str(source.path), backend=runtime, name=source.name, device=opts.device,
                            threads=opts.threads, decode=None if opts.decode == "contract" else opts.decode,
                            tome=None if opts.tome is None else parse_tome(opts.tome), compile=opts.compile,
                            torchscript=opts.torchscript, precision=opts.precision))
    if not isinstance(backend, LocalBackend):  # pragma: no cover - discovery yields local backends only
        raise ValueError(f"{source.path}: predict runs local backends (torch, onnxruntime, openvino, tensorrt)")
    return backend


def decode_file(path: str, cfg: PreprocessConfig, max_pixels: int, naflex: tuple[int, int] | None = None
                ) -> tuple[np.ndarray | None, str | None]:
    """A file -> (its model input [3, H, W] float32, None), or (None, why it cannot be read), decoded as the
    gateway decodes an upload of the same bytes (`vit_serve.runtime.decode`). `naflex` (patch size, max_patches):
    the NaFlex input [1 + max_patches, P*P*3] instead (`decode_naflex`)."""
    from vit_serve.runtime.decode import decode_crop, decode_naflex, input_tensor
    from vit_serve.runtime.errors import ServingError

    if "\n" in path or "\r" in path:
        return None, "a path with a line break cannot be a row key"
    try:
        with open(path, "rb") as f:
            data = f.read()
        if naflex is not None:
            return decode_naflex(data, cfg, max_pixels, *naflex)[0], None
        return input_tensor(decode_crop(data, cfg, max_pixels), cfg)[0], None
    except ServingError as e:  # too large, not an image, corrupt: one line
        return None, e.message
    except OSError as e:
        return None, f"cannot read: {e.strerror or e}"


def batch_tasks(info: ModelInfo, embeddings: bool, explain: bool, max_patches: int | None = None
                ) -> tuple[Task, ...]:
    """What the model runs for each image: classify (or embed, for `embeddings` or a reference that scores the
    embedding; on NaFlex inputs of `max_patches`), then explain with the model's rollout settings when asked for
    (`split_outputs` reads them)."""
    from vit_serve.runtime.task import CLASSIFY, EMBED, Task

    ref = info.reference
    main = EMBED if embeddings or (ref is not None and ref.needs_embedding) else CLASSIFY
    if max_patches is not None:
        main = Task(main.kind, max_patches=max_patches)
    return (main, Task("explain", info.resolve_rollout())) if explain else (main,)


def split_outputs(info: ModelInfo, embeddings: bool, outputs: list[Outputs]
                  ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """The outputs of `batch_tasks`' tasks, in their order -> (logits [B, K], embedding [B, D] or None, rollout
    maps [B, gh, gw] or None, OOD scores [B] or None). The logits are always those of the classify (or embed)
    graph, what `/classify` answers, never the explain graph's; the OOD scores (a model with a reference,
    `vit_serve.monitor.ood_scores`) come from the same pass."""
    from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT
    from vit_serve.monitor import ood_scores

    logits, emb = outputs[0][LOGITS], outputs[0].get(EMBEDDING)
    maps = outputs[1][ROLLOUT] if len(outputs) > 1 else None
    ref = info.reference
    ood = None if ref is None else ood_scores(ref, logits, emb)
    return logits, emb if embeddings else None, maps, ood


def compute(backend: LocalBackend, x: np.ndarray, embeddings: bool, explain: bool
            ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """x [B, 3, H, W] -> `split_outputs` of `batch_tasks` run on the backend in this thread."""
    info = backend.info
    return split_outputs(info, embeddings, [backend.run(t, x) for t in batch_tasks(info, embeddings, explain)])


def make_rows(items: list[Item], logits: np.ndarray, info: ModelInfo, opts: PredictOptions,
              emb: np.ndarray | None = None, rollout_index: list[int] | None = None,
              ood: np.ndarray | None = None) -> list[Row]:
    """The rows of a batch (logits [B, K], emb [B, D], ood [B]): path, [target, target_index], labels, indices,
    scores (`/classify`'s top_k), and [embedding (L2-normalised with `normalize`) and embedding_fingerprint (its
    space's, `vit_serve.fingerprint`), rollout_index, ood_score and ood_flag (above the reference's threshold, as
    `/classify`'s "ood")]."""
    from vit_serve.runtime.postprocess import normalize_embedding, top_k

    fingerprint = None
    if emb is not None:
        emb = normalize_embedding(emb, opts.normalize)  # as POST /embed?normalize=true
        fingerprint = info.embedding_fingerprint(opts.normalize)
    rows = []
    for i, item in enumerate(items):
        best = top_k(logits[i], opts.top_k, info)
        row: Row = {"path": item.path}
        if opts.image_folder:
            row |= {"target": item.target, "target_index": item.target_index}
        row |= {"labels": [b["label"] for b in best], "indices": [b["index"] for b in best],
                "scores": [b["score"] for b in best]}
        if emb is not None:
            row |= {"embedding": emb[i].tolist(), EMBEDDING_FINGERPRINT: fingerprint}
        if rollout_index is not None:
            row["rollout_index"] = rollout_index[i]
        if ood is not None and info.reference is not None:
            row |= {"ood_score": float(ood[i]), "ood_flag": bool(ood[i] > info.reference.threshold)}
        rows.append(row)
    return rows


class Sink:
    """Where a batch's outputs go: the rollout maps first, then the rows (see `writers`)."""

    def __init__(self, writer: Any, rollout: RolloutFile | None, errors: ErrorLog, bar: Any, info: ModelInfo,
                 opts: PredictOptions) -> None:
        self.writer, self.rollout, self.errors, self.bar = writer, rollout, errors, bar
        self.info, self.opts = info, opts
        self.written = 0
        self.first: tuple[float, int] | None = None  # (perf_counter, rows written) after the first batch

    def batch(self, items: list[Item], logits: np.ndarray, emb: np.ndarray | None, maps: np.ndarray | None,
              ood: np.ndarray | None = None) -> None:
        """logits [B, K], emb [B, D] or None, maps [B, gh, gw] or None, ood [B] or None -> B rows written."""
        index = self.rollout.append(maps) if self.rollout is not None and maps is not None else None
        self.writer.write(make_rows(items, logits, self.info, self.opts, emb, index, ood))
        self.written += len(items)
        if self.first is None:
            self.first = (time.perf_counter(), self.written)
        self.bar.update(len(items))

    def error(self, path: str, why: str) -> None:
        self.errors.add(path, why)
        if not self.opts.quiet:
            self.bar.write(f"vit-serve predict: skipped {printable(path)}: {why}")
        self.bar.update(1)
