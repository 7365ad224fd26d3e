"""A served model as the Open Inference Protocol sees it, whatever the transport (HTTP `/v2`, gRPC).

Metadata: inputs `pixel_values` FP32 [-1, 3, H, W] and `image` BYTES [-1] (a request sends one), outputs `logits`
FP32 [-1, K], when the backend can explain `rollout` FP32 [-1, gh, gw], and when the model has one `embedding`
FP32 [-1, D] (the pre-logits representation, `vit_serve.embedding`), and for a model with a reference (monitoring
on) `ood_score` FP32 [-1] (`vit_serve.monitor`: from the same pass; answered only when asked for by name); a model
served with its text tower takes the request parameter `labels` (logits over those labels, zero-shot), and the input
`text` BYTES [-1] instead of an image: the `embedding` of each text (`text_embeddings`). A parsed
request (`v2_protocol.InferRequest`) runs through the one request pipeline (`pipeline.answer_tensors`, whichever
transport): `resolve` says what it asks of a version, `pixels` decodes its input, and `output_tensors` shapes the
typed answer into its outputs (`classification = k` on an output: Triton's classification extension).

A request carries at most `request_bounds` images (`max_images_per_request`, by default the version's max_batch),
checked by the parsers from each input's header. Its encoded images are decoded a few at a time (`decode_window`
at once, so that one request does not fill the shared decode pool's queue) into one [n, 3, H, W] array allocated
once the count is known: the decoded bytes of a request are at most max_images x 3 x H x W float32, plus
`decode_window` decodes in progress (each at most max_pixels). The first image that fails stops the others: the
ones not started never are.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from vit_serve import __version__
from vit_serve.manifest import EMBEDDING, LOGITS, OOD_SCORE, PIXEL_VALUES, ROLLOUT
from vit_serve.runtime.backends.base import ModelInfo
from vit_serve.runtime.postprocess import Answer
from vit_serve.runtime.settings import RunnerLimits
from vit_serve.runtime.task import CLASSIFY, EMBED, Task
from vit_serve.serve import embeddings
from vit_serve.serve.admission import Admission
from vit_serve.serve.errors import BadRequestError, ForbiddenError, NotReadyError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.openai_schema import Item
from vit_serve.serve.repository import ModelRepository
from vit_serve.serve.v2_protocol import IMAGE, InferRequest, OutputTensor, RequestBounds, Tensor, classify

SERVER_NAME = "vit-serve"
EXTENSIONS = ["binary_tensor_data", "classification", "model_repository"]
INPUTS = (PIXEL_VALUES, IMAGE)  # a request sends one of them
TEXT = "text"  # BYTES [n] of UTF-8 texts, for a model served with its text tower: the `embedding` output of each


def server_metadata() -> dict[str, Any]:
    """`{"name", "version", "extensions"}`."""
    return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}


def versions(gateway: Gateway, name: str) -> list[str]:
    """The versions of `name` in service, newest first."""
    served = gateway.repository.served.get(name, {}) if gateway.repository else {}
    return [str(v) for v in sorted(served, reverse=True)]


def repository_of(gateway: Gateway) -> ModelRepository:
    """The repository the model repository extension acts on (HTTP /v2/repository and gRPC alike): 403 when
    the repository API is turned off, 503 while the models are loading."""
    if not gateway.settings.repository.repository_api:
        raise ForbiddenError("the repository API is turned off on this gateway (VIT_SERVE_REPOSITORY_API)")
    if gateway.repository is None:
        raise NotReadyError("the models are loading", headers={"Retry-After": "1"})
    return gateway.repository


def output_specs(info: ModelInfo, ood: bool = False) -> list[dict[str, Any]]:
    """The model's outputs as the metadata lists them: logits, then rollout and embedding when it has them, and
    `ood_score` when its answers are monitored (`ood`: a reference, monitoring on)."""
    outputs = [{"name": LOGITS, "datatype": "FP32", "shape": [-1, info.num_classes]}]
    if info.explain:
        outputs.append({"name": ROLLOUT, "datatype": "FP32", "shape": [-1, *info.grid]})
    if info.embedding_dim:
        outputs.append({"name": EMBEDDING, "datatype": "FP32", "shape": [-1, info.embedding_dim]})
    if ood:
        outputs.append({"name": OOD_SCORE, "datatype": "FP32", "shape": [-1]})
    return outputs


def model_metadata(mv: ModelVersion, versions: list[str]) -> dict[str, Any]:
    """The model's metadata document (`parameters`: the preprocessing contract, the labels, the text tower and
    the embedding output's fingerprint)."""
    info = mv.info
    h, w = info.resolution
    outputs = output_specs(info, mv.monitor is not None)
    return {
        "name": mv.name,
        "versions": versions,
        "platform": f"vit-serve_{mv.backend.name}",
        "inputs": [{"name": PIXEL_VALUES, "datatype": "FP32", "shape": [-1, 3, h, w]},
                   {"name": IMAGE, "datatype": "BYTES", "shape": [-1]},
                   *([{"name": TEXT, "datatype": "BYTES", "shape": [-1]}] if mv.text is not None else [])],
        "outputs": outputs,
        "parameters": {"input": f"send {PIXEL_VALUES} or {IMAGE}" + (f" or {TEXT}" if mv.text is not None else "")
                                + ", one of them",
                       "preprocess": info.preprocess.to_dict(), "labels": info.labels,
                       "text_tower": mv.text_info(),
                       # the space of the embedding output's vectors (`vit_serve.fingerprint`)
                       "embedding_fingerprint": info.embedding_fingerprint() if info.embedding_dim else None},
    }


def request_bounds(mv: ModelVersion, limits: RunnerLimits) -> RequestBounds:
    """What one request to `mv` may carry: `max_images_per_request` images (0: the version's max_batch), the
    version's own (its model's config, over `limits`, the settings'), and for pixel_values that many rows of
    [3, H, W]."""
    own = mv.runner.limits
    images = own.max_images_per_request or own.max_batch
    h, w = mv.info.resolution
    return RequestBounds(images, images * 3 * h * w)


async def decode_images(mv: ModelVersion, items: list[bytes], window: int, max_patches: int | None = None
                        ) -> np.ndarray:
    """Encoded images -> x [n, 3, H, W] float32 (`max_patches`: NaFlex inputs [n, 1 + M, P*P*3]), at most
    `window` decoding at once; the first failure cancels the rest (those waiting never start) and is raised."""
    h, w, p = *mv.info.resolution, mv.info.patch_size
    # the request's whole decoded size, bounded by its count
    x = np.empty((len(items), 3, h, w) if max_patches is None else (len(items), 1 + max_patches, p * p * 3),
                 np.float32)
    todo = iter(enumerate(items))

    async def worker() -> None:
        for i, data in todo:  # one shared iterator: each worker takes the next image when it is free
            decoded = (mv.decode(bytes(data), keep=False) if max_patches is None else
                       mv.decoder.decode_naflex(bytes(data), max_patches))
            x[i] = (await decoded).x[0]

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, min(window, len(items))))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return x


async def pixels(mv: ModelVersion, inputs: dict[str, Tensor], decode_window: int, max_patches: int | None = None
                 ) -> np.ndarray:
    """The request's one input -> x [B, 3, H, W] float32 (images decoded with the model's contract); with
    `max_patches` (a NaFlex budget), encoded images only, each the NaFlex input of that budget [B, 1 + M, P*P*3]."""
    info = mv.info
    unknown = set(inputs) - set(INPUTS)
    if unknown or len(inputs) != 1:
        raise BadRequestError(f"send exactly one input, {PIXEL_VALUES} or {IMAGE} (got {sorted(inputs)})")
    h, w = info.resolution
    if max_patches is not None and IMAGE not in inputs:
        raise BadRequestError(f"parameters.max_patches takes encoded images ({IMAGE}, BYTES), not {PIXEL_VALUES}")
    if PIXEL_VALUES in inputs:
        t = inputs[PIXEL_VALUES]
        if t.datatype not in ("FP32", "FP16", "FP64"):
            raise BadRequestError(f"{PIXEL_VALUES} must be FP32 (got {t.datatype})")
        if len(t.shape) != 4 or t.shape[1:] != [3, h, w] or t.shape[0] < 1:
            raise BadRequestError(f"{PIXEL_VALUES} must have shape [B, 3, {h}, {w}] (got {t.shape})")
        with np.errstate(over="ignore"):
            x = np.asarray(t.data, dtype=np.float32)
        if not np.isfinite(x).all():  # the parsers refused NaN / inf: an FP64 value beyond float32's range
            raise BadRequestError(f"{PIXEL_VALUES}: {t.datatype} values beyond float32's range (|x| > "
                                  f"{float(np.finfo(np.float32).max):.4g})")
        return x
    t = inputs[IMAGE]
    if t.datatype != "BYTES" or not t.data:
        raise BadRequestError(f"{IMAGE} must be BYTES holding at least one encoded image")
    # On the GPU the decoder batches the crops waiting together: let a request's images wait together.
    window = decode_window if mv.decoder.gpu is None else max(decode_window, mv.runner.limits.max_batch)
    return await decode_images(mv, list(t.data), window, max_patches)


def _tasks(mv: ModelVersion, wanted: list[dict[str, Any]], parameters: dict[str, Any], zero_shot: bool
           ) -> list[Task]:
    """The passes the outputs asked for need: explain (with the request's head_fusion / discard_ratio) for the
    rollout, embed for the embedding (both: two passes), else classify; with labels (`zero_shot`) the embed pass
    gives the logits too."""
    names = {out["name"] for out in wanted}
    tasks = [_explain_task(mv, parameters)] if ROLLOUT in names else []
    if zero_shot and (LOGITS in names or EMBEDDING in names or OOD_SCORE in names):
        tasks.append(EMBED)  # the zero-shot task, which `request_labels` resolved once already
    elif EMBEDDING in names or (OOD_SCORE in names and mv.classify_task() == EMBED):
        tasks.append(mv.embed_task())
    return tasks or [CLASSIFY]


def request_labels(mv: ModelVersion, parameters: dict[str, Any]) -> list[str] | None:
    """The request's `labels` parameter (a comma-separated string, or in JSON a list of strings) within the
    gateway's limits (`ModelVersion.parse_labels`), the model able to take them (`zero_shot_task`); None without
    one; 400 beyond."""
    value = parameters.get("labels")
    if value is None:
        return None
    mv.zero_shot_task()
    return mv.parse_labels(value, "parameters.labels")


def _explain_task(mv: ModelVersion, parameters: dict[str, Any]) -> Task:
    hf, dr = parameters.get("head_fusion"), parameters.get("discard_ratio")
    if dr is not None and not isinstance(dr, (int, float)):
        raise BadRequestError("parameters.discard_ratio must be a number")
    if dr is not None and not 0 <= dr < 1:
        raise BadRequestError("parameters.discard_ratio must be in [0, 1)")
    return mv.explain_task("rollout", hf, dr)


@dataclass(frozen=True)
class Wanted:
    """What an inference request asks of a version (`resolve`): its outputs in the order asked (all but ood_score
    when it names none), the passes they need (`tasks`: the first takes the request's arrival), its labels
    (zero-shot; None: none) and the class names its classification outputs use (those labels, or the model's)."""

    outputs: list[dict[str, Any]]
    tasks: tuple[Task, ...]
    labels: list[str] | None
    names: list[str] | None


def resolve(mv: ModelVersion, req: InferRequest) -> Wanted:
    """What `req` asks of `mv`; 400 for an output the model does not have, or labels it cannot take.

    With the request parameter `labels` (a model served with its text tower) `logits` is [B, n] over those labels,
    zero-shot (`vit_serve.runtime.zero_shot`), and its classification names them; at most VIT_SERVE_MAX_LABELS
    labels of VIT_SERVE_MAX_LABEL_CHARS characters (400 beyond)."""
    available = [o["name"] for o in output_specs(mv.info, mv.monitor is not None)]
    wanted = req.outputs if req.outputs is not None else [{"name": n} for n in available if n != OOD_SCORE]
    for out in wanted:
        if out["name"] not in available:
            raise BadRequestError(f"unknown output {out['name']!r}; this model has {available}")
    labels = request_labels(mv, req.parameters)
    tasks = _tasks(mv, wanted, req.parameters, labels is not None)
    asked = req.parameters.get("max_patches")
    budget = mv.patch_budget(asked, "parameters.max_patches") if asked is not None else None
    if budget is not None:  # without it, a NaFlex model answers /v2 at its fixed size (pixel_values or images)
        if any(t.kind == "explain" for t in tasks):
            raise BadRequestError("parameters.max_patches: a NaFlex model's rollout (each image at its own grid) is "
                                  "served by POST /explain?max_patches=, not as a /v2 output")
        tasks = [dataclasses.replace(t, max_patches=budget) for t in tasks]
    return Wanted(wanted, tuple(tasks), labels, labels if labels is not None else mv.info.labels)


async def text_embeddings(mv: ModelVersion, req: InferRequest, admission: Admission) -> tuple[Wanted, Answer]:
    """A request whose input is `text` (BYTES, UTF-8): the text tower's embedding of each, [n, E] FP32 as the
    `embedding` output (not normalised, as the images' `embedding`), in the text tower's thread under the request's
    level and deadline (`embeddings.encode_texts`); 400 for another input beside it, another output, labels, or a
    text that is not UTF-8 or over the tower's context length."""
    if set(req.inputs) != {TEXT}:
        raise BadRequestError(f"send {TEXT} alone (got {sorted(req.inputs)})")
    t = req.inputs[TEXT]
    if t.datatype != "BYTES" or not t.data:
        raise BadRequestError(f"{TEXT} must be BYTES holding at least one UTF-8 text")
    wanted = req.outputs if req.outputs is not None else [{"name": EMBEDDING}]
    if [o["name"] for o in wanted] != [EMBEDDING] or "labels" in req.parameters:
        raise BadRequestError(f"a {TEXT} input answers the {EMBEDDING} output alone (no labels)")
    try:
        texts = [bytes(v).decode("utf-8") for v in t.data]
    except UnicodeDecodeError:
        raise BadRequestError(f"{TEXT}: not UTF-8 text") from None
    limits = mv.runner.limits
    embeddings.check_items(mv, [Item(text=v) for v in texts], None, limits.max_images_per_request or limits.max_batch)
    vectors = await embeddings.encode_texts(mv, texts, admission)
    return Wanted(wanted, (), None, None), Answer(tensors={EMBEDDING: vectors})


def output_tensors(req: InferRequest, wanted: Wanted, answer: Answer) -> list[OutputTensor]:
    """The answer's tensors as the outputs `req` asked for, in order: FP32 tensors, or their classification
    (`classification = k`: Triton's extension, the class names on the logits only), raw or not as asked."""
    return [_output(o, answer.tensors[o["name"]], req.binary_output(o), wanted.names) for o in wanted.outputs]


def _output(out: dict[str, Any], arr: np.ndarray, binary: bool, labels: list[str] | None) -> OutputTensor:
    """One requested output: the FP32 tensor, or its classification (`labels` on the logits only)."""
    k = InferRequest.class_count(out)
    if k == 0:
        return OutputTensor(out["name"], "FP32", list(arr.shape), arr, binary)
    shape, items = classify(arr, k, labels if out["name"] == LOGITS else None)
    return OutputTensor(out["name"], "BYTES", shape, items, binary)
