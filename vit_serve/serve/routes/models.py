"""GET /models: the repository's models, their versions and states, for people and for the web page; GET
/models/{name}/compare: the live agreement of its primary with its shadow and canaries (`compare`); GET
/models/{name}/drift: a version's recent answers against its reference (`monitoring`)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, Field

from vit_serve.monitor import score_histogram
from vit_serve.serve.deps import GatewayDep
from vit_serve.serve.errors import NotFoundError, NotReadyError
from vit_serve.serve.gateway import Gateway
from vit_serve.serve.model_version import ModelVersion
from vit_serve.serve.monitoring import NO_REFERENCE
from vit_serve.serve.repository import ModelRepository
from vit_serve.serve.schemas import DriftResponse, ErrorBody, ModelsResponse, TrafficSpec

router = APIRouter(tags=["models"])
NameDep = Annotated[str, Path(description="a model of the repository (GET /models lists them)")]


class LatencyInfo(BaseModel):
    p50_ms: float
    p99_ms: float


class AgreementInfo(BaseModel):
    version: int = Field(description="the shadow or canary version")
    primary: int = Field(description="the primary version it is compared with")
    role: str = Field(description="shadow or canary")
    pairs: int = Field(description="request pairs in the window")
    images: int = Field(description="images of those pairs")
    top1_agreement: float | None = Field(description="share of images with the same top-1 class")
    logit_abs_delta: float | None = Field(description="mean over images of mean |logit delta| (null: class "
                                          "counts differ)")
    embedding_cosine: float | None = Field(description="mean cosine of the embeddings (embed requests; else null)")
    primary_latency: LatencyInfo | None = Field(description="queue wait + model run of the primary's side")
    other_latency: LatencyInfo | None = Field(description="the same, of this version's side")


class CompareResponse(BaseModel):
    model: str
    window: int = Field(description="request pairs kept per version (compare_window)")
    policy: TrafficSpec | None = Field(description="the traffic policy in force (null: none)")
    versions: list[AgreementInfo]


def _repository(gateway: GatewayDep) -> ModelRepository:
    repo = gateway.repository
    if repo is None:
        raise NotReadyError("the models are loading", headers={"Retry-After": "1"})
    return repo


def policy_of(repo: ModelRepository, name: str) -> TrafficSpec | None:
    """The model's traffic policy as the API shows it (None: none)."""
    policy = repo.traffic.get(name)
    return None if policy is None else policy.to_spec(repo.served.get(name, {}))


def _batching(mv: ModelVersion) -> dict | None:
    """A batching runner's batch limit, wait and measured curve (`schemas.BatchingInfo`); None for a direct one."""
    info = mv.runner.batching
    return None if info is None else asdict(info)


def explain_support(mv: ModelVersion) -> dict:
    """What /explain answers for `mv` (`schemas.ExplainSupport`): what `ModelVersion.explain_task` accepts."""
    info = mv.info
    methods = ["rollout"] if info.explain else []
    if mv.backend.supports_grad_rollout:
        methods.append("grad_rollout")
    fixed = info.rollout if info.explain else None
    return {"methods": methods, "head_fusion": fixed.head_fusion if fixed else None,
            "discard_ratio": fixed.discard_ratio if fixed else None}


def _unmonitored(gateway: Gateway, mv: ModelVersion) -> str:
    """Why a version without a monitor has none (its /models `monitoring` and its drift's 404)."""
    if not gateway.settings.monitor.monitoring:
        return ("monitoring is off on this gateway (--no-monitoring / VIT_SERVE_MONITORING=false): no OOD scores, "
                "no drift")
    if mv.info.reference is None:
        return NO_REFERENCE
    return "its reference does not fit this model's outputs (see the gateway's log): OOD scores and drift are off"


def _monitoring(gateway: Gateway, mv: ModelVersion) -> dict | str:
    """A version's `monitoring` (`schemas.MonitoringInfo`), or why it has none."""
    return mv.monitor.describe() if mv.monitor is not None else _unmonitored(gateway, mv)


def _loaded(gateway: Gateway, mv: ModelVersion) -> dict:
    """What /models shows of a loaded version (`schemas.VersionInfo`'s fields past its state)."""
    info = mv.info
    return dict(backend=mv.backend.name, resolution=info.resolution, num_classes=info.num_classes,
                explain=info.explain, explain_support=explain_support(mv), memory_bytes=mv.memory_bytes,
                in_flight=mv.in_flight,
                token_merging=None if info.token_merging is None else {
                    "r": list(info.token_merging.r), "prop_attn": info.token_merging.prop_attn},
                batching=_batching(mv), compiled=info.compiled, torchscript=info.torchscript,
                monitoring=_monitoring(gateway, mv), precision=info.precision, device=info.device_name or info.device,
                accuracy=None if info.accuracy is None else info.accuracy.to_dict(),
                runtime_choice=None if info.runtime_choice is None else asdict(info.runtime_choice))


@router.get("/models", response_model=ModelsResponse)
async def models(gateway: GatewayDep) -> dict:
    """Every model of the repository: `{"default_model", "model_control", "models": [{"name", "default",
    "versions": [{"version", "state", "reason", "backend", "resolution", "num_classes", "explain", "explain_support",
    "memory_bytes", "in_flight", "token_merging", "batching", "compiled", "torchscript", "monitoring", "precision",
    "device", "accuracy", "runtime_choice"}]}]}`. States
    are Triton's (READY, LOADING, UNLOADING, UNAVAILABLE with its reason); a model never loaded has one entry with
    version and state null. `explain_support`: the /explain methods and rollout settings it answers.
    `batching`: the batch limit and wait its batch curve set (`schemas.BatchingInfo`). `traffic`: its traffic
    policy (`{"traffic": {version: weight}, "shadow", "primary"}`, null without one). `runtime_choice`: the
    runtimes timed at load and the one that serves (`schemas.RuntimeChoiceInfo`). `monitoring`: the reference
    its OOD scores and drift compare with (`schemas.MonitoringInfo`), or a line saying why there is none."""
    repo = _repository(gateway)
    default = repo.default_name
    out: dict[str, dict] = {}
    for row in repo.index():
        entry = out.setdefault(row.name, {"name": row.name, "default": row.name == default, "versions": [],
                                          "traffic": policy_of(repo, row.name)})
        version = {"version": row.version, "state": row.state, "reason": row.reason}
        mv = repo.served.get(row.name, {}).get(row.version) if row.version is not None else None
        if mv is not None:
            version.update(_loaded(gateway, mv))
        entry["versions"].append(version)
    return {"default_model": default, "model_control": gateway.settings.repository.model_control,
            "models": list(out.values())}


@router.get("/models/{name}/compare", response_model=CompareResponse, responses={404: {"description": "unknown model"}})
async def compare(name: NameDep, gateway: GatewayDep) -> CompareResponse:
    """The live agreement of `name`'s primary with each shadow / canary version over the last `compare_window`
    request pairs (top-1 agreement, mean |logit delta|, embedding cosine, each side's latency p50 / p99), and its
    traffic policy. A version without pairs yet is not listed."""
    repo = _repository(gateway)
    if name not in repo.entries and name not in repo.served:
        raise repo.unknown(name)
    compare = repo.traffic.compare
    versions = [AgreementInfo.model_validate(dataclasses.asdict(a)) for a in compare.summaries(name)]
    return CompareResponse(model=name, window=compare.size, policy=policy_of(repo, name), versions=versions)


@router.get("/models/{name}/drift", response_model=DriftResponse,
            responses={404: {"model": ErrorBody, "description": "unknown model or version, a version without a "
                                                                "reference, or monitoring off"}})
async def drift(name: NameDep, gateway: GatewayDep, version: Annotated[int | None, Query(
        description="the version (default: the newest in service)")] = None) -> dict:
    """How far the version's window of recent answers (the last drift_window images answered by /classify and
    /embed) has moved from its reference: one two-sample Kolmogorov-Smirnov test per feature (confidence, OOD
    score, the embedding's first principal projections), Bonferroni-corrected; `alarm` when the p-value is below
    drift_significance with at least drift_min_window images. Also the window's OOD rate (against the rate
    expected, 1 - the threshold's quantile), the classes whose top-1 share moved most, and both score
    histograms. Computed when asked (cached until the window grows)."""
    repo = _repository(gateway)
    served = repo.served.get(name)
    mv = repo.get(name, version if version is not None or not served else max(served))  # its usual 404 / 503
    monitor = mv.monitor
    if monitor is None:
        raise NotFoundError(f"{mv.label} is not monitored: {_unmonitored(gateway, mv)}")
    ref, report = monitor.ref, monitor.report()
    hist = score_histogram(ref, monitor.window.arrays()[1])
    return {"model": mv.name, "version": str(mv.version), "method": ref.method, "window": report.window,
            "window_size": monitor.window.size, "statistic": report.statistic, "p_value": report.p_value,
            "alarm": report.alarm, "significance": report.significance, "min_window": report.min_window,
            "threshold": ref.threshold, "ood_rate": report.ood_rate, "expected_ood_rate": 1.0 - ref.quantile,
            "features": {k: {"distance": d, "p_value": pv} for k, (d, pv) in report.features.items()},
            "classes": [{"label": mv.info.label(i), "index": i, "reference_share": before, "window_share": after}
                        for i, before, after in report.classes],
            "histogram": dataclasses.asdict(hist)}
