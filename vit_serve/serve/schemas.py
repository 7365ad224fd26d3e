"""Response bodies of the gateway's own routes (they make /docs meaningful), and the one JSON encoder every JSON
body goes through. Shapes are stable.

Strict JSON: RFC 8259 has no token for NaN or infinity, so a non-finite number (say from an fp16 engine that
overflows) is written as `null`, on every route (`json_bytes`, used by `StrictJSONResponse`, the app's default
response class, and by the /v2 encoder). Triton writes `NaN` / `Infinity` tokens instead, which strict parsers
(orjson in KServe's SDK, browsers' `JSON.parse`) refuse; tritonclient and KServe's SDK read `null` back as NaN.
The /v2 binary tensor extension carries the exact IEEE values.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
import pydantic_core
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


def _fallback(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_bytes(content: Any) -> bytes:
    """`content` as RFC 8259 JSON (UTF-8, compact): NaN and +-inf become null; numpy arrays and scalars are lists
    and numbers."""
    return pydantic_core.to_json(content, inf_nan_mode="null", fallback=_fallback)


class StrictJSONResponse(JSONResponse):
    """A JSON response that never holds a NaN or Infinity token (`json_bytes`)."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class Prediction(BaseModel):
    label: str = Field(description="class name (class_<index> when the model has no labels)")
    index: int = Field(description="class index into the logits")
    score: float | None = Field(description="softmax probability (null when the model's logits are not finite)")


class Timing(BaseModel):
    decode: float = Field(description="ms decoding and preprocessing the upload (0 when reused from the store)")
    queue: float = Field(description="ms waiting for a batch to start")
    infer: float = Field(description="ms the batch took on the model")
    total: float = Field(description="ms from the start of the request to the answer")
    batch_size: int = Field(description="images in the batch this one ran in")


# The map's fields, shared by the rollout in a classify answer and GET /explain's answer.
MapQuery = Annotated[Literal["cls", "patch-mean", "map-probe", "text", "image", "label"], Field(
    description="rows of the rollout the map comes from: the [class] token's, or the mean of the patch rows for "
                "GAP models; method=similarity: what the image was compared with (text=, query_id=, label=)")]
# and "map-probe": the attention-pool probe's row, for MAP models (SigLIP)
MapGrid = Annotated[tuple[int, int], Field(description="(gh, gw) = (H / P, W / P)")]
RelevanceMap = Annotated[list[list[float | None]], Field(
    description="gh rows of gw relevances over the patch grid of the model-input crop (null where not finite)")]


class Explanation(BaseModel):
    method: Literal["rollout"]
    head_fusion: str = Field(description="rollout head fusion (the explain graph's, or the library default)")
    discard_ratio: float = Field(description="rollout discard ratio (the explain graph's, or the library default)")
    query: MapQuery
    grid: MapGrid
    map: RelevanceMap


class OodScore(BaseModel):
    """How unlike its model's reference an image is (`vit_serve.monitor.ood_scores`), from the pass that answered."""

    score: float | None = Field(description="higher is less like the reference's images (null: not finite)")
    flag: bool = Field(description="score above the threshold")
    method: Literal["mahalanobis", "energy"] = Field(description="mahalanobis (the embedding's distance to the "
                                                     "reference's Gaussian) or energy (-logsumexp of the logits)")
    threshold: float = Field(description="the reference's calibration quantile of the score")


class Abstention(BaseModel):
    abstained: bool = Field(description="true: none of these labels (the best label's score is below the threshold)")
    score: float | None = Field(description="the best label's score, the one compared (null where not finite)")
    threshold: float = Field(description="the threshold it was compared with")
    source: Literal["request", "reference"] = Field(description="where the threshold came from: the request's "
                                                    "threshold=, or calibrated from the model's reference")


class ClassifyResponse(BaseModel):
    id: str = Field(description="the image's id for this API key (not its sha256); pass it to GET /explain")
    model: str
    version: str = Field(description="the model version that answered")
    resolution: tuple[int, int] = Field(description="model input (H, W)")
    predictions: list[Prediction] = Field(description="top_k classes, best first")
    timing_ms: Timing
    explanation: Explanation | None = Field(None, description="?explain=true only: the attention rollout of the "
                                            "same forward pass (absent otherwise)")
    ood: OodScore | None = Field(None, description="models with a reference only (absent otherwise, and with labels): "
                                 "the image's OOD score from the same pass")
    abstention: Abstention | None = Field(None, description="?labels=&abstain=true only (absent otherwise)")


class EmbedResponse(BaseModel):
    id: str = Field(description="the image's id for this API key (not its sha256); pass it to GET /explain")
    model: str
    version: str = Field(description="the model version that answered")
    resolution: tuple[int, int] = Field(description="model input (H, W)")
    dim: int = Field(description="D, the embedding's length")
    normalized: bool = Field(description="whether the embedding was L2-normalised (?normalize=true)")
    embedding: list[float | None] = Field(description="the pre-logits image representation, forward_head("
                                                      "pre_logits=True) (null where not finite)")
    embedding_fingerprint: str | None = Field(
        description="the embedding space's identity (vit_serve.fingerprint): vectors are comparable only with "
                    "vectors of the same fingerprint (null: an export from before manifests stated it)")
    timing_ms: Timing
    layer: int | None = Field(None, description="tokens=patch: the block whose output the tokens are (0-based)")
    grid: tuple[int, int] | None = Field(None, description="tokens=patch: the patch grid (gh, gw)")
    patch_tokens: list[list[float | None]] | None = Field(
        None, description="tokens=patch: gh * gw rows (row-major over the grid) of the block's D floats, before the "
                          "final norm (timm's forward_intermediates(norm=False)); absent otherwise")


class ExplainResponse(BaseModel):
    id: str = Field(description="the image's id for this API key (not its sha256)")
    model: str
    version: str = Field(description="the model version that answered")
    method: Literal["rollout", "grad_rollout", "similarity"]
    head_fusion: str | None = Field(description="rollout head fusion (None for grad_rollout)")
    discard_ratio: float | None = Field(description="rollout discard ratio (None for grad_rollout)")
    query: MapQuery
    grid: MapGrid
    map: RelevanceMap
    predictions: list[Prediction] = Field(description="top classes of the same forward pass (empty for grad_rollout "
                                                      "and similarity)")
    timing_ms: Timing
    cosine: float | None = Field(None, description="method=similarity: the cosine of the image's embedding and the "
                                 "query; the map's sum plus `rest` (absent otherwise)")
    rest: float | None = Field(None, description="method=similarity: the part of the cosine no patch holds (the "
                               "residual stream, the biases, the prefix tokens; 0 up to the biases for mean-pooled "
                               "models)")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    model: str | None = None
    backend: str | None = None
    reason: str | None = Field(None, description="why not ready")


class TokenMergingInfo(BaseModel):
    r: list[int] = Field(description="tokens merged in each layer")
    prop_attn: bool = Field(description="attention proportional to the merged tokens' sizes")


class BatchingInfo(BaseModel):
    """How a version's batcher batches, from its batch curve (`vit_serve.runtime.batch_curve`)."""

    max_batch: int = Field(description="the largest batch it runs: the configured max_batch, or less where the "
                           "batch curve shows larger batches are no faster per image")
    max_delay_ms: float = Field(description="how long it waits for a batch to fill (0: never, where waiting does "
                                "not pay)")
    images_per_s: dict[int, float] = Field(default_factory=dict, description="the model's measured images/s by "
                                           "batch size at warm-up (empty: not measured)")
    instances: int = Field(1, description="model instances, each running a batch at once (Triton's "
                           "instance_group count; the curve is one instance's)")


class RuntimeRowInfo(BaseModel):
    """One runtime timed when a version loaded (`vit_serve.runtime.runtime_choice.Row`)."""

    runtime: str = Field(description="eager, onnxruntime, ...")
    precision: str = Field(description="fp32, bf16, int8, ...")
    images_per_s: dict[int, float] = Field(description="images/s by batch size (batch 1 and the batch limit; "
                                           "empty: not measured)")
    agreement: float | None = Field(description="top-1 agreement with the fp32 reference on a fixed batch")
    cosine: float | None = Field(description="mean cosine of its logits with the reference's")
    refused: str | None = Field(description="why it may not serve (its accuracy bounds, a failed build); null: a "
                                "contender")


class RuntimeChoiceInfo(BaseModel):
    """Which runtime serves a version and why (`vit_serve.runtime.runtime_choice.RuntimeChoice`)."""

    chosen: str = Field(description="runtime:precision of the one that serves")
    pinned: bool = Field(description="pinned by pin_runtime (nothing measured)")
    threads: int = Field(description="intra-op threads the runtimes ran on (0: each runtime's default)")
    seconds: float = Field(description="how long the choice took at load")
    rows: list[RuntimeRowInfo] = Field(description="every runtime considered, the reference first")


class MonitoringInfo(BaseModel):
    """What a version's reference watches (`vit_serve.monitor.Reference`)."""

    method: Literal["mahalanobis", "energy"] = Field(description="how its OOD scores are computed")
    threshold: float = Field(description="the score above which an image is flagged")
    quantile: float = Field(description="the calibration quantile the threshold is")
    calibration_images: int = Field(description="images the threshold and the drift sample come from")
    description: str = Field(description="the reference in one line")


class ExplainSupport(BaseModel):
    """What GET / POST /explain answers for a version, so that a client offers only that (the web page disables
    the rest, saying why)."""

    methods: list[Literal["rollout", "grad_rollout"]] = Field(description="the methods it answers (grad_rollout: "
                                                             "the torch backend only; empty: no explain graph)")
    head_fusion: str | None = Field(description="the only head fusion it computes (an exported explain graph's, "
                                    "baked in); null: any of mean, max, min")
    discard_ratio: float | None = Field(description="the only discard ratio it computes (an exported explain "
                                        "graph's, baked in); null: any in [0, 1)")


class AccuracyInfo(BaseModel):
    """A reduced precision against fp32 on the accuracy gate's real photos at load
    (`vit_serve.runtime.accuracy_gate`, judged by `vit_serve.accuracy_bounds`)."""

    precision: str = Field(description="the precision measured (bf16, fp16, int8)")
    n: int = Field(description="the real photos (crops) it ran")
    agreement: float = Field(description="top-1 agreement with fp32, a fraction")
    cosine: float = Field(description="the mean cosine to fp32 (of the logits, and of the embedding when the graph "
                          "gives one: the smaller), judged")
    worst_cosine: float = Field(description="the smallest single cosine, reported, not judged")
    min_agreement: float = Field(description="the precision's bound on agreement")
    min_cosine: float = Field(description="the precision's bound on cosine")
    ok: bool = Field(description="whether both bounds were met")
    forced: bool = Field(description="served although it missed (force_precision)")
    rollout_max_abs: float | None = Field(None, description="the largest |difference| of its explain graph's rollout "
                                          "maps from fp32's on the same photos (reported, not judged; null: no "
                                          "explain graph)")


class VersionInfo(BaseModel):
    version: int | None = Field(description="the version (null: a model of the repository never loaded)")
    state: Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"] | None = Field(
        description="Triton's states; null for a model never loaded")
    reason: str = Field("", description="why it is not READY (a load error, \"unloaded\", ...)")
    backend: str | None = Field(None, description="torch, onnxruntime, openvino, tensorrt or triton (loaded "
                                "versions)")
    resolution: tuple[int, int] | None = Field(None, description="model input (H, W) (loaded versions)")
    num_classes: int | None = None
    explain: bool | None = Field(None, description="whether /explain can draw its attention rollout")
    explain_support: ExplainSupport | None = Field(None, description="the /explain methods and rollout settings it "
                                                   "answers (loaded versions)")
    memory_bytes: int | None = Field(None, description="resident memory the version took to load (RSS growth)")
    in_flight: int | None = Field(None, description="requests holding it now")
    token_merging: TokenMergingInfo | None = Field(None, description="the token merging (ToMe) it runs (null: none)")
    batching: BatchingInfo | None = Field(None, description="its batcher (null: a server that batches, e.g. Triton)")
    compiled: bool | None = Field(None, description="whether the torch backend runs it through torch.compile")
    torchscript: bool | None = Field(None, description="whether the torch backend runs it as a TorchScript trace")
    runtime_choice: RuntimeChoiceInfo | None = Field(None, description="the runtimes timed at load and the one "
                                                     "chosen (null: no choice made, e.g. --no-choose-runtime)")
    monitoring: MonitoringInfo | str | None = Field(None, description="its reference (OOD scores, drift), or a line "
                                                    "saying why it has none (loaded versions)")
    precision: str | None = Field(None, description="the precision it computes in (fp32, bf16, fp16, int8)")
    device: str | None = Field(None, description="where it runs (cpu, cuda, remote), or the device as its runtime "
                               "reports it (OpenVINO's CPU name)")
    accuracy: AccuracyInfo | None = Field(None, description="the accuracy gate's measurement of its reduced "
                                          "precision against fp32 at load (null: fp32, or not measured)")


class ShadowSpec(BaseModel):
    """A shadow version as the API shows it."""

    version: int = Field(description="the version that runs the copies")
    share: float = Field(100.0, description="percent of the primary's answers copied to it, (0, 100]")


class TrafficSpec(BaseModel):
    """A traffic policy as the API takes and shows it (`POST /v2/repository/models/NAME/traffic`)."""

    traffic: dict[str, float] = Field(default_factory=dict, description="weights by version (relative); empty: "
                                      "the newest version in service takes every request")
    shadow: ShadowSpec | None = Field(None, description="the shadow version, or null")
    primary: int | None = Field(None, description="the version the split treats as primary now (the largest "
                                "weight in service; answers only, ignored in a request)")


class ModelEntryInfo(BaseModel):
    name: str
    default: bool = Field(description="whether requests naming no model get this one")
    versions: list[VersionInfo]
    traffic: TrafficSpec | None = Field(None, description="its traffic policy between versions (weights, shadow, "
                                        "the primary now; null: none)")


class ModelsResponse(BaseModel):
    default_model: str | None = Field(description="the model of requests that name none (null: several models "
                                                  "and no --default-model)")
    model_control: Literal["none", "poll", "explicit"]
    models: list[ModelEntryInfo]


class FeatureDrift(BaseModel):
    distance: float = Field(description="the two-sample KS distance of the window to the reference")
    p_value: float = Field(description="its asymptotic p-value (not corrected)")


class ClassShare(BaseModel):
    label: str
    index: int
    reference_share: float = Field(description="its share of the reference's top-1 answers")
    window_share: float = Field(description="its share of the window's top-1 answers")


class ScoreHistogram(BaseModel):
    edges: list[float] = Field(description="bin edges shared by both counts (bins + 1)")
    window: list[int] = Field(description="the window's OOD scores per bin")
    reference: list[int] = Field(description="the reference's calibration scores per bin")


class DriftResponse(BaseModel):
    """A version's window of recent answers against its reference (`vit_serve.monitor.drift`)."""

    model: str
    version: str
    method: Literal["mahalanobis", "energy"]
    window: int = Field(description="images in the window now")
    window_size: int = Field(description="images the window holds at most (drift_window)")
    statistic: float = Field(description="the largest KS distance over the features")
    p_value: float = Field(description="the smallest p-value times the number of features (Bonferroni, at most 1)")
    alarm: bool = Field(description="p_value below significance, with at least min_window images")
    significance: float
    min_window: int
    threshold: float = Field(description="the OOD flag's threshold")
    ood_rate: float = Field(description="share of the window flagged")
    expected_ood_rate: float = Field(description="the share expected of in-distribution images: 1 - quantile")
    features: dict[str, FeatureDrift] = Field(description="each feature compared: confidence, ood_score, "
                                              "projection_i (the embedding on the reference's principal directions)")
    classes: list[ClassShare] = Field(description="the classes whose share of top-1 answers moved most")
    histogram: ScoreHistogram = Field(description="the window's and the reference's OOD scores, binned alike")


class ErrorBody(BaseModel):
    detail: str = Field(description="what was wrong with the request, in one line")
