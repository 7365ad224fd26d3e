"""Response bodies of the gateway's own routes (they make /docs meaningful). Shapes are stable."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Prediction(BaseModel):
    label: str = Field(description="class name (class_<index> when the model has no labels)")
    index: int = Field(description="class index into the logits")
    score: float = Field(description="softmax probability")


class Timing(BaseModel):
    decode: float = Field(description="ms decoding and preprocessing the upload (0 when reused from the store)")
    queue: float = Field(description="ms waiting for a batch to start")
    infer: float = Field(description="ms the batch took on the model")
    total: float = Field(description="ms from the start of the request to the answer")
    batch_size: int = Field(description="images in the batch this one ran in")


class ClassifyResponse(BaseModel):
    id: str = Field(description="sha256 hex of the image bytes; pass it to GET /explain")
    model: str
    resolution: tuple[int, int] = Field(description="model input (H, W)")
    predictions: list[Prediction] = Field(description="top_k classes, best first")
    timing_ms: Timing


class ExplainResponse(BaseModel):
    id: str = Field(description="sha256 hex of the image bytes")
    model: str
    method: Literal["rollout", "grad_rollout"]
    head_fusion: str | None = Field(description="rollout head fusion (None for grad_rollout)")
    discard_ratio: float | None = Field(description="rollout discard ratio (None for grad_rollout)")
    query: Literal["cls", "patch-mean"] = Field(
        description="rows of the rollout the map comes from: the [class] token's, or the mean of the patch rows "
                    "for GAP models")
    grid: tuple[int, int] = Field(description="(gh, gw) = (H / P, W / P)")
    map: list[list[float]] = Field(description="gh rows of gw relevances over the patch grid of the model-input crop")
    predictions: list[Prediction] = Field(description="top classes of the same forward pass (empty for grad_rollout)")
    timing_ms: Timing


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    model: str | None = None
    backend: str | None = None
    reason: str | None = Field(None, description="why not ready")


class ErrorBody(BaseModel):
    detail: str = Field(description="what was wrong with the request, in one line")
