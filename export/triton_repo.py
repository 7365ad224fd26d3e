"""The Triton model repository writer: an exported ONNX pair (+ optional TensorRT engine) -> Triton models.

For an export named NAME (`NAME.onnx`, `NAME_explain.onnx` and their sidecars), the repository gets

    NAME_onnx/            platform onnxruntime_onnx    pixel_values [3, H, W] -> logits [K] (labels.txt)
                                                       (+ embedding [D] with `vit-export --outputs logits,embedding`)
    NAME_explain_onnx/    platform onnxruntime_onnx    pixel_values -> logits [K], rollout [gh, gw]
    NAME_trt/             platform tensorrt_plan       (only with an engine) model_smXY.plan per compute capability
    NAME_openvino/        backend openvino             (only with `--format openvino`) the logits graph's IR,
                                                       model.xml + model.bin (f32, or NNCF int8), CPU
    NAME_py/              backend python               the ONNX graph run by onnxruntime inside Triton's Python
    NAME_explain_py/      backend python               backend (servers that have only that backend)
    NAME_preprocess/      backend python               image [1] (encoded bytes) -> pixel_values [3, H, W]
    NAME_ensemble/        platform ensemble            image -> NAME_preprocess -> classifier -> logits [K]
                                                       (+ embedding [D] when the classifier has it)

each as `<model>/config.pbtxt` (+ labels.txt, warmup/) and `<model>/<version>/...`. Dims exclude the batch axis
(max_batch_size > 0: Triton's dynamic batcher forms the batches). Every config carries a "vit_serve" parameter
(`vit_serve.manifest.TritonMeta` as JSON: resolution, patch size, labels, the preprocessing contract, the explain
model's name, rollout settings, the manifests' sha256) so that a gateway needs nothing but `get_model_config`.

Writing a model that exists adds the next version and never touches existing versions; an export whose inputs,
outputs or labels differ from the existing model is refused before anything is written. A new model is built
in a hidden folder beside the repository (a polling Triton would try to load any folder inside it), a new
version in a hidden folder inside its model folder (Triton ignores non-numeric ones), then renamed into place.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vit_export.triton_config import (
    Batching,
    Tensor,
    ensemble_config,
    io_signature,
    model_config,
    parse,
    to_text,
)
from vit_export.triton_models import template_text

from vit_serve.checkpoints.io import atomic_write
from vit_serve.manifest import (
    EMBEDDING,
    EMBEDDING_FINGERPRINT,
    LOGITS,
    PIXEL_VALUES,
    ROLLOUT,
    TRITON_MANIFEST,
    TRITON_ONNX,
    ExportManifest,
    TensorRTBuild,
    TritonMeta,
    file_sha256,
    manifest_path,
    read_manifest,
)

ENSEMBLE_TARGETS = ("onnx", "trt", "py")
DEFAULT_MAX_PIXELS = 50_000_000
LABELS_FILE = "labels.txt"
WARMUP_IMAGE = "image.bin"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_IMAGE = Tensor("image", "TYPE_STRING", (1,))  # the preprocess model's and the ensemble's input: encoded bytes


@dataclass(frozen=True)
class WrittenModel:
    """One model written: its name, the version added and the version folder."""

    model: str
    version: int
    path: Path


@dataclass
class _Plan:
    """A model to write: its config, files for the new version folder, and model-level files."""

    name: str
    config: Any
    version_files: dict[str, Path | bytes] = field(default_factory=dict)
    model_files: dict[str, bytes] = field(default_factory=dict)


def model_names(name: str) -> dict[str, str]:
    """Model names for an export named `name`, by role."""
    return {
        "onnx": f"{name}_onnx",
        "explain_onnx": f"{name}_explain_onnx",
        "trt": f"{name}_trt",
        "openvino": f"{name}_openvino",
        "py": f"{name}_py",
        "explain_py": f"{name}_explain_py",
        "preprocess": f"{name}_preprocess",
        "ensemble": f"{name}_ensemble",
    }


def _read_sidecar(onnx_path: Path, explain: bool) -> tuple[ExportManifest, str]:
    """The manifest of an exported graph for the repository, and the sha256 of its JSON."""
    side_path = manifest_path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"no such ONNX file: {onnx_path}")
    if not side_path.is_file():
        raise FileNotFoundError(f"no sidecar beside {onnx_path} (expected {side_path}); export with vit-export")
    side = read_manifest(onnx_path)
    if side.explain != explain:
        what = "an explain graph" if explain else "a logits graph (not the explain graph)"
        raise ValueError(f"{onnx_path} is not {what}")
    if side.batch != "dynamic":
        raise ValueError(
            f"{onnx_path} has a fixed batch size ({side.batch}); Triton's dynamic batcher needs a dynamic "
            "batch axis: export with --batch dynamic (the batch limit is --max-batch)"
        )
    return side, file_sha256(side_path)


def _warmup_image() -> bytes:
    """A small real PNG, length-prefixed as Triton reads TYPE_STRING warmup data (uint32 length, then bytes)."""
    import numpy as np
    from PIL import Image

    g = np.linspace(0, 255, 48, dtype=np.uint8)
    rgb = np.stack([np.tile(g, (32, 1)), np.tile(g[::-1], (32, 1)), np.full((32, 48), 128, np.uint8)], -1)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    png = buf.getvalue()
    return struct.pack("<I", len(png)) + png


@dataclass(frozen=True)
class EngineFiles:
    """What the repository needs of a TensorRT engine: the plan file, its GPU architecture, and the build summary
    its models' metadata carries (precision, batch profile, whether its parity check passed)."""

    path: Path
    file: str
    compute_capability: str
    precision: str | None = None
    batch: tuple[int, ...] | list[int] | None = None
    parity_ok: bool | None = None

    @classmethod
    def of(cls, engine: TensorRTBuild | Mapping[str, Any]) -> EngineFiles:
        """From `build_engine`'s `TensorRTBuild`, or a mapping with its JSON keys ("path", "file",
        "compute_capability", and optionally "precision", "batch", "parity")."""
        if isinstance(engine, TensorRTBuild):
            ok = None if engine.parity is None else engine.parity.ok
            return cls(Path(engine.path), engine.file, engine.compute_capability, engine.precision, engine.batch, ok)
        return cls(Path(engine["path"]), str(engine["file"]), str(engine["compute_capability"]),
                   engine.get("precision"), engine.get("batch"), (engine.get("parity") or {}).get("ok"))

    def summary(self) -> dict[str, Any]:
        """`TritonMeta.tensorrt`: compute_capability, file, precision, batch, parity_ok."""
        return {"compute_capability": self.compute_capability, "file": self.file, "precision": self.precision,
                "batch": self.batch, "parity_ok": self.parity_ok}


@dataclass(frozen=True)
class ModelSettings:
    """How the models run in Triton: dynamic batching, instances per model, the onnxruntime models' instance
    kind ("cpu" | "gpu") and intra-op threads, and the preprocess model's decoded-size limit."""

    batching: Batching
    instances: int = 1
    onnx_device: str = "cpu"
    threads: int = 1
    max_pixels: int = DEFAULT_MAX_PIXELS


@dataclass(frozen=True)
class _Contract:
    """One export as its models state it, read once from the two manifests: the model names by role, the
    tensors (dims without the batch axis), the warmup samples, the labels file and the metadata every model
    carries (`TritonMeta`, specialised per model by `meta`)."""

    names: dict[str, str]
    pixels: Tensor
    logits: Tensor
    rollout: Tensor
    heads: tuple[Tensor, ...]
    warmup: tuple[dict[str, Any], ...]
    labels: dict[str, bytes]
    base: TritonMeta

    def meta(self, **fields: Any) -> dict[str, str]:
        """The "vit_serve" config parameter of one model (and "embedding_fingerprint"). The reference (OOD scores
        and drift) and the embedding space ride on the models that give the logits graph's outputs (the onnxruntime
        and Python classifiers, the ensemble over one), never on an explain, preprocess or TensorRT model, which
        lack the embedding output."""
        meta = dataclasses.replace(self.base, **fields)
        if meta.kind in ("explain", "preprocess") or meta.runtime == "tensorrt" or \
                meta.classifier == self.names.get("trt"):
            meta = dataclasses.replace(meta, reference=None, embedding_space=None)
        space = meta.embedding_space
        # the fingerprint also as a parameter of its own, for a client that reads the config without our schema
        return {"vit_serve": meta.to_json(), **({EMBEDDING_FINGERPRINT: space.fingerprint} if space else {})}


def _contract(name: str, onnx_path: Path, explain_path: Path, batching: Batching) -> _Contract:
    side, side_sha = _read_sidecar(onnx_path, explain=False)
    ex_side, ex_sha = _read_sidecar(explain_path, explain=True)
    if side.resolution != ex_side.resolution or side.labels != ex_side.labels:
        raise ValueError(f"{onnx_path.name} and {explain_path.name} come from different exports")
    assert ex_side.rollout is not None  # read_manifest requires it of an explain graph
    res, patch, labels = side.resolution, side.architecture.patch_size, side.labels
    if res == "dynamic":
        pixel_dims, grid = (3, -1, -1), "dynamic"
    else:
        pixel_dims, grid = (3, res[0], res[1]), (res[0] // patch, res[1] // patch)
    logits = Tensor(LOGITS, "TYPE_FP32", (side.num_classes,), LABELS_FILE if labels else None)
    # The logits graph's outputs: logits, and the embedding when the export has one (the TensorRT engine never).
    heads = (logits, *([Tensor(EMBEDDING, "TYPE_FP32", (side.embedding_dim,))] if side.embedding_dim else []))
    warmup = () if res == "dynamic" else (  # warmup needs concrete dims; a dynamic-resolution graph has none
        {"name": "zeros_batch_1", "batch_size": 1, "inputs": {PIXEL_VALUES: {"zero_data": True}}},
        {"name": f"random_batch_{batching.max_batch}", "batch_size": batching.max_batch,
         "inputs": {PIXEL_VALUES: {"random_data": True}}},
    )
    pool = ex_side.rollout.pool or side.architecture.pool
    names = model_names(name)
    base = TritonMeta(
        name=name, kind="logits", runtime="onnxruntime", resolution=res, patch_size=patch, grid=grid,
        num_classes=side.num_classes, labels=labels, preprocess=side.preprocess,
        rollout=dataclasses.replace(ex_side.rollout, pool=pool), pool=pool, precision=side.precision,
        sidecar_sha256=side_sha, explain_sidecar_sha256=ex_sha, onnx_sha256=side.file_sha256,
        source_checkpoint_sha256=None if side.source_checkpoint is None else side.source_checkpoint.sha256,
        preprocess_model=names["preprocess"], embedding=side.embedding, scores=side.scores,
        token_merging=side.token_merging, reference=side.reference, embedding_space=side.embedding_space,
    )
    return _Contract(
        names, Tensor(PIXEL_VALUES, "TYPE_FP32", pixel_dims), logits,
        Tensor(ROLLOUT, "TYPE_FP32", (-1, -1) if grid == "dynamic" else grid), heads, warmup,
        {LABELS_FILE: ("\n".join(labels) + "\n").encode()} if labels else {}, base,
    )


def _graph_plans(c: _Contract, onnx_path: Path, explain_path: Path, s: ModelSettings) -> list[_Plan]:
    """The onnxruntime and Python-backend models of both graphs."""
    ort_params = {"intra_op_thread_count": str(s.threads), "inter_op_thread_count": "1"}
    py_params = {"intra_op_num_threads": str(s.threads)}
    plans = []
    for role, src, outputs, explain_role in (
        ("onnx", onnx_path, c.heads, "explain_onnx"),
        ("explain_onnx", explain_path, (c.logits, c.rollout), None),
        ("py", onnx_path, c.heads, "explain_py"),
        ("explain_py", explain_path, (c.logits, c.rollout), None),
    ):
        python = role.endswith("py")
        links = {"explain_model": c.names[explain_role]} if explain_role else {"logits_model": c.names[role[8:]]}
        kind = "logits" if explain_role else "explain"
        cfg = model_config(
            c.names[role], [c.pixels], list(outputs), s.batching,
            platform=None if python else "onnxruntime_onnx", backend="python" if python else None,
            instances=s.instances, kind="cpu" if python else s.onnx_device, warmup=list(c.warmup),
            parameters={
                **(py_params if python else ort_params if s.onnx_device == "cpu" else {}),
                **c.meta(kind=kind, runtime="python" if python else "onnxruntime", **links),
            },
        )
        files: dict[str, Path | bytes] = {TRITON_ONNX: src, TRITON_MANIFEST: manifest_path(src)}
        if python:
            files["model.py"] = template_text("onnx_classifier").encode()
        plans.append(_Plan(c.names[role], cfg, files, dict(c.labels)))
    return plans


def _engine_plan(c: _Contract, engine: EngineFiles, s: ModelSettings) -> _Plan:
    """The tensorrt_plan model (GPU), its batch capped by the engine's optimisation profile."""
    batching = s.batching
    if engine.batch is not None:
        batching = Batching(min(batching.max_batch, int(engine.batch[2])), batching.queue_delay_us,
                            batching.max_queue)
    cfg = model_config(
        c.names["trt"], [c.pixels], [c.logits], batching, platform="tensorrt_plan", instances=s.instances,
        kind="gpu", warmup=list(c.warmup),
        parameters=c.meta(kind="logits", runtime="tensorrt", explain_model=c.names["explain_onnx"],
                          tensorrt=engine.summary()),
        cc_model_filenames={engine.compute_capability: engine.file},
    )
    return _Plan(c.names["trt"], cfg, {engine.file: engine.path}, dict(c.labels))


# The OpenVINO backend's names for an IR in a version folder (its default_model_filename is model.xml).
OPENVINO_XML, OPENVINO_BIN = "model.xml", "model.bin"


def _openvino_plan(c: _Contract, xml: Path, s: ModelSettings) -> _Plan:
    """The OpenVINO backend's model of the logits graph's IR (CPU; OpenVINO picks the inference precision, bf16
    where the CPU has it). The backend's own parameters: a latency hint (Triton's dynamic batcher forms the
    batches, one request per instance at a time) and the threads of each instance."""
    ir = read_manifest(xml)
    cfg = model_config(
        c.names["openvino"], [c.pixels], list(c.heads), s.batching, backend="openvino", instances=s.instances,
        kind="cpu", warmup=list(c.warmup),
        parameters={"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": str(s.threads),
                    **c.meta(kind="logits", runtime="openvino", precision=ir.precision,
                             explain_model=c.names["explain_onnx"])},
    )
    files: dict[str, Path | bytes] = {OPENVINO_XML: xml, OPENVINO_BIN: xml.with_suffix(".bin"),
                                      TRITON_MANIFEST: manifest_path(xml)}
    return _Plan(c.names["openvino"], cfg, files, dict(c.labels))


def _preprocess_plan(c: _Contract, s: ModelSettings) -> _Plan:
    """The Python model that decodes image bytes into pixel_values."""
    cfg = model_config(
        c.names["preprocess"], [_IMAGE], [c.pixels], s.batching, backend="python", instances=s.instances,
        kind="cpu",
        warmup=[{"name": "png_batch_1", "batch_size": 1, "inputs": {"image": {"input_data_file": WARMUP_IMAGE}}}],
        parameters={"max_pixels": str(s.max_pixels), **c.meta(kind="preprocess", runtime="python")},
    )
    return _Plan(c.names["preprocess"], cfg, {"model.py": template_text("preprocess").encode()},
                 {f"warmup/{WARMUP_IMAGE}": _warmup_image()})


def _ensemble_plan(c: _Contract, plans: list[_Plan], target: str, batching: Batching) -> _Plan:
    """image -> the preprocess model -> the `target` classifier ("onnx" | "trt" | "py")."""
    classifier = next(p.config for p in plans if p.name == c.names[target])
    explain_of = "explain_py" if target == "py" else "explain_onnx"
    heads = list(c.heads) if target != "trt" else [c.logits]
    cfg = ensemble_config(
        c.names["ensemble"], [_IMAGE], heads,
        min(classifier.max_batch_size, batching.max_batch),
        [
            (c.names["preprocess"], {"image": "image"}, {PIXEL_VALUES: PIXEL_VALUES}),
            (c.names[target], {PIXEL_VALUES: PIXEL_VALUES}, {t.name: t.name for t in heads}),
        ],
        parameters=c.meta(kind="ensemble", runtime="ensemble", classifier=c.names[target],
                          explain_model=c.names[explain_of]),
    )
    return _Plan(c.names["ensemble"], cfg, {}, dict(c.labels))


def _plans(name: str, onnx_path: Path, explain_path: Path, engine: EngineFiles | None, settings: ModelSettings,
           ensemble_target: str, openvino: Path | None = None) -> list[_Plan]:
    """Every model of one export, in the order they are written (the ensemble last)."""
    c = _contract(name, onnx_path, explain_path, settings.batching)
    plans = _graph_plans(c, onnx_path, explain_path, settings)
    if engine is not None:
        plans.append(_engine_plan(c, engine, settings))
    if openvino is not None:
        plans.append(_openvino_plan(c, openvino, settings))
    plans.append(_preprocess_plan(c, settings))
    plans.append(_ensemble_plan(c, plans, ensemble_target, settings.batching))
    return plans


def _next_version(repo: Path, plan: _Plan) -> int:
    """1 for a new model; else max(existing) + 1 after checking the export matches the existing model."""
    folder = repo / plan.name
    if not folder.exists():
        return 1
    config_file = folder / "config.pbtxt"
    if not config_file.is_file():
        raise ValueError(
            f"{folder} exists but is not a Triton model folder (no config.pbtxt); remove it or pick "
            "another name (vit-export --name)"
        )
    old = parse(config_file.read_text())
    old_sig, new_sig = io_signature(old), io_signature(plan.config)
    old_labels = (folder / LABELS_FILE).read_bytes() if (folder / LABELS_FILE).is_file() else None
    new_labels = plan.model_files.get(LABELS_FILE)
    if old_sig != new_sig or old.platform != plan.config.platform or old.backend != plan.config.backend:
        raise ValueError(
            f"{folder} holds a model with other inputs/outputs ({_describe(old_sig)}; this export: "
            f"{_describe(new_sig)}); Triton serves one signature per model: pick another name (vit-export --name)"
        )
    if old_labels != new_labels:
        raise ValueError(f"{folder} holds a model with other class labels; pick another name (vit-export --name)")
    versions = [int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(versions, default=0) + 1


def _describe(sig: dict[str, list[tuple[str, str, tuple[int, ...]]]]) -> str:
    def one(ts: list[tuple[str, str, tuple[int, ...]]]) -> str:
        return ", ".join(f"{n} {t.removeprefix('TYPE_')}{list(d)}" for n, t, d in ts)

    return f"{one(sig['inputs'])} -> {one(sig['outputs'])}"


def _fill(folder: Path, files: dict[str, Path | bytes]) -> None:
    for rel, src in files.items():
        dest = folder / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, Path):
            shutil.copyfile(src, dest)
        else:
            dest.write_bytes(src)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging(repo: Path) -> Path:
    """Where a new model folder is built: beside the repository (a Triton polling the repository would try to
    load any folder inside it), or inside it when the parent is another filesystem (rename needs one)."""
    parent = repo.resolve().parent
    same_fs = os.access(parent, os.W_OK) and parent.stat().st_dev == repo.stat().st_dev
    return parent if same_fs else repo


def _write(repo: Path, plan: _Plan, version: int) -> WrittenModel:
    folder = repo / plan.name
    if version == 1:  # a new model: build it whole beside the repository, then rename into place
        tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}.{plan.name}.", suffix=".tmp", dir=_staging(repo)))
        try:
            (tmp / "1").mkdir()
            _fill(tmp / "1", plan.version_files)
            _fill(tmp, {"config.pbtxt": to_text(plan.config).encode(), **plan.model_files})
            os.rename(tmp, folder)  # fails if another writer created it meanwhile
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(repo)
        return WrittenModel(plan.name, 1, folder / "1")
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", suffix=".tmp", dir=folder))
    try:
        _fill(tmp, plan.version_files)
        os.rename(tmp, folder / str(version))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Model-level files describe the newest version (the configs serve the latest one only).
    for rel, data in {"config.pbtxt": to_text(plan.config).encode(), **plan.model_files}.items():
        atomic_write(folder / rel, data, overwrite=True)
    _fsync_dir(folder)
    return WrittenModel(plan.name, version, folder / str(version))


def write_repository(
    onnx_path: str | os.PathLike,
    explain_path: str | os.PathLike,
    repo: str | os.PathLike = "model_repo",
    name: str | None = None,
    engine: TensorRTBuild | Mapping[str, Any] | None = None,
    *,
    max_batch: int = 16,
    instances: int = 1,
    ensemble_target: str | None = None,
    onnx_device: str = "cpu",
    queue_delay_us: int = 1000,
    max_queue: int = 128,
    threads: int = 1,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    openvino: str | os.PathLike | None = None,
) -> list[WrittenModel]:
    """Write (or add a version of) the Triton models of one export into `repo`; returns what was written.

    onnx_path / explain_path: `NAME.onnx` and `NAME_explain.onnx` with their sidecars (dynamic batch).
    name: the model-name stem (default: the ONNX file's stem). engine: `vit_export.tensorrt_build.build_engine`'s
    `TensorRTBuild` (or a mapping of its JSON keys, at least "path", "compute_capability", "file") or None.
    ensemble_target: which classifier the ensemble calls, "onnx" | "trt" | "py" (default "trt" with an engine,
    else "onnx"). onnx_device: instance kind of the onnxruntime models, "cpu" | "gpu" (TensorRT is always GPU,
    Python models CPU). threads: intra-op threads of each onnxruntime session. max_pixels: the preprocess
    model's decoded-size limit. openvino: the logits graph's IR (`vit_export.openvino_ir`, with its manifest):
    adds the OpenVINO backend's model NAME_openvino.
    """
    onnx_path, explain_path, repo = Path(onnx_path), Path(explain_path), Path(repo)
    name = name or onnx_path.stem
    if not _NAME.match(name):
        raise ValueError(f"bad model name {name!r}: use letters, digits, '_', '-' and '.', starting alphanumeric")
    target = ensemble_target or ("trt" if engine is not None else "onnx")
    if target not in ENSEMBLE_TARGETS:
        raise ValueError(f"unknown ensemble target {target!r}; expected one of {', '.join(ENSEMBLE_TARGETS)}")
    if target == "trt" and engine is None:
        raise ValueError("the ensemble cannot target 'trt' without a TensorRT engine (--format tensorrt)")
    if threads < 1 or max_pixels < 1:
        raise ValueError("threads and max_pixels must be >= 1")
    settings = ModelSettings(Batching(max_batch, queue_delay_us, max_queue), instances, onnx_device, threads,
                             max_pixels)
    files = None if engine is None else EngineFiles.of(engine)
    plans = _plans(name, onnx_path, explain_path, files, settings, target, None if openvino is None else Path(openvino))
    repo.mkdir(parents=True, exist_ok=True)
    versions = [_next_version(repo, p) for p in plans]  # every check before the first write
    return [_write(repo, p, v) for p, v in zip(plans, versions, strict=True)]
