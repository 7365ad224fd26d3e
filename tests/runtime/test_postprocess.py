"""One typed answer from a pass's outputs (`vit_serve.runtime.postprocess`): what each kind of request gets, with
no web framework and no model (outputs written by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vit_serve.manifest import EMBEDDING, LOGITS, ROLLOUT, RolloutSettings
from vit_serve.preprocess import PreprocessConfig
from vit_serve.runtime.backends.base import ModelInfo
from vit_serve.runtime.postprocess import Ood, Prediction, Shape, answer, by_labels, rollout_payload, top_k

INFO = ModelInfo(name="m", resolution=(32, 32), patch_size=16, num_classes=3, labels=["a", "b", "c"],
                 preprocess=PreprocessConfig(input_size=(32, 32)))
OUTPUTS = {LOGITS: np.array([[0.0, 2.0, 1.0]], np.float32), EMBEDDING: np.array([[3.0, 4.0]], np.float32),
           ROLLOUT: np.array([[[0.1, 0.2], [0.3, 0.4]]], np.float32)}


def test_classify_answer_holds_the_best_classes_and_the_ood_verdict():
    ood = Ood(1.5, True, "energy", 1.0)
    got = answer(OUTPUTS, INFO, Shape(top_k=2), ood)
    assert [(p.label, p.index) for p in got.predictions] == [("b", 1), ("c", 2)]
    assert got.prediction_dicts() == top_k(OUTPUTS[LOGITS][0], 2, INFO)
    assert got.ood is ood and got.embedding is None and got.explanation is None


def test_embed_answer_is_the_embedding_normalised_or_not():
    assert answer(OUTPUTS, INFO, Shape(embedding=True)).embedding.tolist() == [3.0, 4.0]
    np.testing.assert_allclose(answer(OUTPUTS, INFO, Shape(embedding=True, normalize=True)).embedding, [0.6, 0.8])
    assert answer(OUTPUTS, INFO, Shape(embedding=True)).predictions == ()


@pytest.mark.parametrize("rollout", [None, RolloutSettings("max", 0.5)])
def test_explain_answer_writes_its_map_as_the_rollout_payload(rollout):
    got = answer({ROLLOUT: OUTPUTS[ROLLOUT]}, INFO, Shape(top_k=5, logits_optional=True, explain="rollout",
                                                          rollout=rollout))
    assert got.predictions == ()  # an explain pass without logits
    assert got.explanation.payload() == rollout_payload("rollout", rollout, OUTPUTS[ROLLOUT][0], INFO)
    assert got.explanation.payload()["head_fusion"] == (None if rollout is None else "max")


@pytest.mark.parametrize("names", [(LOGITS,), (ROLLOUT, EMBEDDING), ()])
def test_a_tensor_answer_keeps_the_outputs_it_names_whole(names):
    """The Open Inference Protocol's answer (/v2, gRPC): each output named, every row, as the pass gave it."""
    two_rows = {k: np.concatenate([v, v + 1]) for k, v in OUTPUTS.items()}
    got = answer(two_rows, INFO, Shape(tensors=names))
    assert list(got.tensors) == list(names)
    assert all(got.tensors[n] is two_rows[n] for n in names)
    assert got.predictions == () and got.embedding is None and got.explanation is None


def test_labels_answer_indexes_the_requests_labels():
    got = by_labels(np.array([1.0, 3.0, 3.0, -1.0]), ["w", "x", "y", "z"], 3, "softmax")
    assert [(p.label, p.index) for p in got.predictions] == [("x", 1), ("y", 2), ("w", 0)]  # ties by index
    assert math.isclose(sum(p.score for p in by_labels(np.zeros(4), list("wxyz"), 4, "softmax").predictions), 1.0)
    assert by_labels(np.zeros(2), ["p", "q"], 5, "sigmoid").predictions == (Prediction("p", 0, 0.5),
                                                                             Prediction("q", 1, 0.5))
