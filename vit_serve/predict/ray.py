"""`vit-serve predict --engine ray`: the same job on Ray Data (the optional extra `vit-serve[ray]`).

The images still to do → `ray.data.from_items` (row number and path) → `map_batches(ModelActor)`, a pool of actors
each holding the serving backend → the driver, which streams the results (`iter_batches`) into the local engine's
writer. Images are decoded with the gateway's functions (`vit_serve.predict.batch.decode_file`). On CPUs there is one
actor per CPU of the cluster (`--actors N` otherwise), each decoding its batch and then running it on one
intra-op thread: the actors overlap each other. On GPUs (`--device cuda`, or auto on a cluster with GPUs) there is
one actor per GPU, reserving no CPU, fed by a separate `map_batches(decode_batch)` stage of CPU tasks, so that the
GPUs never wait for their own decoding.

Why the driver writes rather than `Dataset.write_parquet`: the rows, formats, manifest, kill safety (parts renamed
into place), resume, errors file and rollout .npy are then the local engine's, exactly; workers writing Parquet
themselves would leave half-written files behind a kill and could not list the unreadable files without a second
pass. The driver receives only the model's outputs (logits, and embeddings or maps when asked), not images. SRC
must be readable at the same paths on every node of the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from vit_serve.manifest import EMBEDDING, LOGITS, OOD_SCORE, ROLLOUT
from vit_serve.predict.batch import Item, Sink, compute, decode_file, load_backend
from vit_serve.predict.options import PredictOptions

if TYPE_CHECKING:
    from vit_serve.preprocess import PreprocessConfig
    from vit_serve.runtime.discovery import VersionSource


def require_ray() -> None:
    """ImportError naming the extra when Ray Data is not installed."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--engine ray needs Ray Data: pip install 'vit-serve[ray]' ({e})") from e


def decode_batch(batch: dict[str, np.ndarray], cfg: PreprocessConfig, max_pixels: int) -> dict[str, np.ndarray]:
    """{"row", "path"} -> {"row", "x" [B, 3, H, W] (zeros where unreadable), "error" ("" where readable)}."""
    h, w = cfg.input_size
    xs, errors = [], []
    for path in batch["path"]:
        x, why = decode_file(str(path), cfg, max_pixels)
        xs.append(np.zeros((3, h, w), np.float32) if x is None else x)
        errors.append("" if x is not None else (why or "unreadable"))
    return {"row": batch["row"], "x": np.stack(xs), "error": np.array(errors, dtype=object)}


class ModelActor:
    """One loaded serving backend in a Ray actor: batches (decoded, or paths when `decode`) -> logits
    [, embedding] [, rollout]."""

    def __init__(self, source: VersionSource, opts: PredictOptions, decode: bool) -> None:
        self.backend = load_backend(source, opts)
        self.opts, self.decode = opts, decode
        self.backend.warmup()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.decode:
            batch = decode_batch(batch, self.backend.info.preprocess, self.opts.max_pixels)
        ok = batch["error"] == ""
        out: dict[str, np.ndarray] = {"row": batch["row"], "error": batch["error"]}
        n = len(batch["row"])
        info = self.backend.info
        logits = np.zeros((n, info.num_classes), np.float32)
        emb = np.zeros((n, info.embedding_dim), np.float32) if self.opts.embeddings else None
        maps = np.zeros((n, *info.grid), np.float32) if self.opts.explain else None
        ood = np.zeros(n, np.float32) if info.reference is not None else None
        if ok.any():
            got_logits, got_emb, got_maps, got_ood = compute(self.backend, np.ascontiguousarray(batch["x"][ok]),
                                                             self.opts.embeddings, self.opts.explain)
            logits[ok] = got_logits
            if ood is not None and got_ood is not None:
                ood[ok] = got_ood
            if emb is not None and got_emb is not None:
                emb[ok] = got_emb
            if maps is not None and got_maps is not None:
                maps[ok] = got_maps
        out[LOGITS] = logits
        if emb is not None:
            out[EMBEDDING] = emb
        if maps is not None:
            out[ROLLOUT] = maps
        if ood is not None:
            out[OOD_SCORE] = ood
        return out


def _actors(opts: PredictOptions, resources: dict[str, float]) -> tuple[int, dict[str, Any]]:
    """How many model actors, and what each reserves: a GPU each (and no CPU) on CUDA, else a CPU each."""
    if opts.device == "cuda" or (opts.device == "auto" and resources.get("GPU", 0) >= 1):
        gpus = int(resources.get("GPU", 0))
        if gpus < 1:
            raise ValueError("--engine ray --device cuda: the Ray cluster has no GPU")
        return opts.actors or gpus, {"num_gpus": 1, "num_cpus": 0}
    return opts.actors or max(1, int(resources.get("CPU", 1))), {"num_cpus": 1}


def model_stage(n: int, reserve: dict[str, Any]) -> dict[str, Any]:
    """`map_batches` arguments of the model stage besides the function: a fixed pool of `n` actors
    (`compute=ActorPoolStrategy(size=n)`, Ray Data's form since 2.51, where `concurrency=` is deprecated) each
    reserving `reserve`."""
    import ray.data

    return {"compute": ray.data.ActorPoolStrategy(size=n), **reserve}


def run_ray(source: VersionSource, todo: list[Item], sink: Sink, opts: PredictOptions) -> None:
    """Predict `todo` on a Ray cluster (`opts.address`; none: the one this process runs, or a new local one) and
    hand each result batch to `sink`."""
    require_ray()
    import dataclasses
    import logging

    import ray
    import ray.data

    started = not ray.is_initialized()
    if started:
        ray.init(address=opts.address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours counts rows as they are written
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        n, reserve = _actors(opts, ray.cluster_resources())
        on_gpu = "num_gpus" in reserve
        # one intra-op thread per CPU actor unless told: there is an actor per CPU
        actor_opts = dataclasses.replace(opts, threads=opts.threads or (None if on_gpu else 1))
        ds = ray.data.from_items([{"row": i, "path": item.path} for i, item in enumerate(todo)])
        if on_gpu:
            ds = ds.map_batches(decode_batch, batch_size=opts.batch_size, num_cpus=1,
                                fn_kwargs={"cfg": sink.info.preprocess, "max_pixels": opts.max_pixels})
        ds = ds.map_batches(ModelActor, batch_size=opts.batch_size, **model_stage(n, reserve),
                            fn_constructor_kwargs={"source": source, "opts": actor_opts, "decode": not on_gpu})
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            rows = [int(r) for r in batch["row"]]
            good = [j for j, e in enumerate(batch["error"]) if e == ""]
            for j, e in enumerate(batch["error"]):
                if e != "":
                    sink.error(todo[rows[j]].path, str(e))
            if good:
                sink.batch([todo[rows[j]] for j in good], batch[LOGITS][good],
                           batch[EMBEDDING][good] if EMBEDDING in batch else None,
                           batch[ROLLOUT][good] if ROLLOUT in batch else None,
                           batch[OOD_SCORE][good] if OOD_SCORE in batch else None)
    finally:
        if started:
            ray.shutdown()
