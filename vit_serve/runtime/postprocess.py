"""What a model's outputs become in an answer, whoever answers (HTTP, gRPC, offline prediction): the top-k classes of
a row of logits (or of zero-shot logits over a request's labels), the rollout payload of a map, the L2-normalised
embedding and the OOD verdict, or for the Open Inference Protocol (/v2, gRPC) the named output tensors whole, gathered
in one typed `Answer` (`answer`). Pure numpy, no I/O, no web framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vit_serve.embedding import l2_normalize
from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT
from vit_serve.runtime.task import COSINE, GRID, PATCH_TOKENS, REST

if TYPE_CHECKING:
    from vit_serve.manifest import RolloutSettings
    from vit_serve.runtime.backends.base import ModelInfo
    from vit_serve.runtime.task import Outputs

__all__ = ["Abstention", "Answer", "Explanation", "Ood", "Prediction", "Shape", "abstain", "answer", "by_labels",
           "l2_normalize", "normalize_embedding", "predictions", "rollout_payload", "rollout_query", "scores", "top_k"]


@dataclass(frozen=True)
class Prediction:
    """One class of an answer: its label, its index (into the model's classes, or into the request's labels) and
    its score (NaN for non-finite logits: the JSON encoder writes null)."""

    label: str
    index: int
    score: float


@dataclass(frozen=True)
class Ood:
    """How unlike the model's reference an image is (`vit_serve.monitor`): its score, whether it is above the
    threshold, the method and the threshold."""

    score: float
    flag: bool
    method: str
    threshold: float


@dataclass(frozen=True)
class Abstention:
    """Zero-shot abstention (?labels=&abstain=true): the best label's `score`, the `threshold` it was compared
    with and where that came from ("request" or "reference"), and whether the answer is "none of these"."""

    abstained: bool
    score: float
    threshold: float
    source: str


def abstain(answer: Answer, threshold: float, source: str) -> Answer:
    """The answer with its abstention: "none of these" when its best label's score is below `threshold` (NaN
    abstains)."""
    best = answer.predictions[0].score if answer.predictions else float("nan")
    return dataclasses.replace(answer, abstention=Abstention(not best >= threshold, best, threshold, source))


@dataclass(frozen=True)
class Explanation:
    """An attention map [gh, gw] and how it was made (`rollout_payload` writes it as the answers do)."""

    method: str
    rollout: RolloutSettings | None
    heat: np.ndarray
    query: str
    grid: Any
    # a similarity map's cosine and the part of it no patch holds (method "similarity"; None otherwise)
    cosine: float | None = None
    rest: float | None = None

    def payload(self) -> dict[str, Any]:
        """{"method", "head_fusion", "discard_ratio", "query", "grid", "map"} (and "cosine", "rest" for a
        similarity map), as GET /explain?format=json."""
        r = self.rollout
        out = {"method": self.method, "head_fusion": r.head_fusion if r is not None else None,
               "discard_ratio": r.discard_ratio if r is not None else None, "query": self.query,
               "grid": self.grid, "map": self.heat.tolist()}
        if self.cosine is not None:
            out.update(cosine=self.cosine, rest=self.rest)
        return out


@dataclass(frozen=True)
class Answer:
    """One image's answer, whatever was asked: its best classes, its embedding, its attention map, its OOD
    verdict (each empty when not asked for or not available); or a request's named output tensors, every row
    (`tensors`: the Open Inference Protocol's logits, rollout, embedding, ood_score)."""

    predictions: tuple[Prediction, ...] = ()
    embedding: np.ndarray | None = None
    explanation: Explanation | None = None
    ood: Ood | None = None
    tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    patch_tokens: np.ndarray | None = None  # [gh * gw, D]: /embed?tokens=patch
    abstention: Abstention | None = None  # /classify?labels=&abstain=true

    def prediction_dicts(self) -> list[dict[str, Any]]:
        """The predictions as the answers' {"label", "index", "score"} objects."""
        return [dataclasses.asdict(p) for p in self.predictions]


@dataclass(frozen=True)
class Shape:
    """What an answer holds: `top_k` classes of the logits (None: none; `logits_optional`: none when the pass gave
    no logits, as an explain pass may), the map of the `explain` method (with the `rollout` settings its task
    ran with), the embedding (`normalize`d or not), the outputs named in `tensors` whole (every row, as they are)."""

    top_k: int | None = None
    logits_optional: bool = False
    explain: str | None = None
    rollout: RolloutSettings | None = None
    embedding: bool = False
    normalize: bool = False
    tensors: tuple[str, ...] = ()
    patch_tokens: bool = False


def answer(outputs: Outputs, info: ModelInfo, shape: Shape, ood: Ood | None = None) -> Answer:
    """The first row of a pass's `outputs` as the typed answer `shape` asks for (with the OOD verdict the caller's
    monitor gave, if any), and the outputs it names in `tensors`, whole."""
    found = None
    if shape.top_k is not None and not (shape.logits_optional and LOGITS not in outputs):
        found = predictions(outputs[LOGITS][0], shape.top_k, info)
    explanation = None
    if shape.explain is not None:
        heat, grid = outputs[ROLLOUT][0], info.grid
        if GRID in outputs:  # NaFlex: the image's own grid, its map flat in the first h * w entries
            grid = tuple(int(v) for v in outputs[GRID][0])
            heat = heat[:grid[0] * grid[1]].reshape(grid)
        explanation = Explanation(shape.explain, shape.rollout, heat, rollout_query(info.pool), grid)
        if COSINE in outputs:
            explanation = dataclasses.replace(explanation, cosine=float(outputs[COSINE][0]),
                                              rest=float(outputs[REST][0]))
    embedding = normalize_embedding(outputs[EMBEDDING][0], shape.normalize) if shape.embedding else None
    tokens = outputs[PATCH_TOKENS][0] if shape.patch_tokens else None
    return Answer(found or (), embedding, explanation, ood, {name: outputs[name] for name in shape.tensors},
                  tokens)


def by_labels(logits: np.ndarray, labels: list[str], k: int, kind: str) -> Answer:
    """Zero-shot logits [n] over a request's `labels` -> the answer of the k best, best first (ties by index);
    `index` is the label's position in `labels`; scores softmax over the labels or sigmoid (`kind`)."""
    from vit_serve.runtime.zero_shot import label_scores

    p = label_scores(logits, kind)
    best = np.argsort(-logits.astype(np.float64), kind="stable")[:min(k, len(labels))]
    return Answer(tuple(Prediction(labels[i], int(i), float(p[i])) for i in best))


def scores(logits: np.ndarray, kind: str = "softmax") -> np.ndarray:
    """logits [K] -> float64 scores [K]: softmax (one label per image), or the element-wise sigmoid
    1 / (1 + exp(-z)) of SigLIP's heads (each label on its own; big_vision / open_clip's SigLIP zero-shot)."""
    z = logits.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "sigmoid":
            return 0.5 * (1.0 + np.tanh(0.5 * z))  # = sigmoid(z), without exp overflow
        p = np.exp(z - z.max())
        return p / p.sum()


def predictions(logits: np.ndarray, k: int, info: ModelInfo) -> tuple[Prediction, ...]:
    """logits [K] -> the k best classes (scores softmax, or sigmoid when `info.scores` says so), best first (by
    logit: ties by index, NaN last). Non-finite logits give NaN scores."""
    z = logits.astype(np.float64)
    p = scores(z, info.scores)
    best = np.argsort(-z, kind="stable")[:min(k, z.shape[0])]
    return tuple(Prediction(info.label(int(i)), int(i), float(p[i])) for i in best)


def top_k(logits: np.ndarray, k: int, info: ModelInfo) -> list[dict[str, Any]]:
    """logits [K] -> the k best classes as {"label", "index", "score"} (`predictions`), best first. Non-finite
    logits give NaN scores, which the JSON encoder writes as null."""
    return [dataclasses.asdict(p) for p in predictions(logits, k, info)]


def rollout_query(pool: str) -> str:
    """Which rows of the rollout a map is read from: "cls" for token-pooled models, "patch-mean" for GAP ones,
    "map-probe" for attention-pooled ones (SigLIP), as `vit_serve.explain.QUERIES`."""
    from vit_serve.explain import QUERIES

    return QUERIES.get(pool, "patch-mean")


def rollout_payload(method: str, rollout: RolloutSettings | None, heat: np.ndarray, info: ModelInfo
                    ) -> dict[str, Any]:
    """A map heat [gh, gw] -> {"method", "head_fusion", "discard_ratio", "query", "grid": [gh, gw], "map": gh x gw
    floats}, as GET /explain?format=json and POST /classify?explain=true answer it (head_fusion and discard_ratio
    None when the method runs without rollout settings)."""
    return Explanation(method, rollout, heat, rollout_query(info.pool), info.grid).payload()


def normalize_embedding(emb: np.ndarray, normalize: bool) -> np.ndarray:
    """emb [..., D] -> itself, or L2-normalised along D (float32) with `normalize`, as POST /embed?normalize=true."""
    return l2_normalize(emb) if normalize else emb
