"""vit_serve.predict.ray.model_stage: the model stage's `map_batches` arguments in Ray Data's current form.

Reference: Ray Data's own resolution of those arguments (`ray.data._internal.util.get_compute_strategy`, what
`Dataset.map_batches` calls), which logs "The argument ``concurrency`` is deprecated in Ray 2.51" for the old
form (removed in a later Ray). No cluster is started: the arguments are resolved as `map_batches` resolves them.
"""

from __future__ import annotations

import logging

import pytest

ray_data = pytest.importorskip("ray.data")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resolve(**kwargs):
    """The compute strategy Ray Data makes of `map_batches(ModelActor, **kwargs)`, and what it logged."""
    from ray.data._internal.util import get_compute_strategy

    from vit_serve.predict.ray import ModelActor

    logger = logging.getLogger("ray.data._internal.util")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        strategy = get_compute_strategy(ModelActor, compute=kwargs.get("compute"),
                                        concurrency=kwargs.get("concurrency"))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return strategy, records.messages


def test_model_stage_is_a_fixed_actor_pool_without_the_deprecated_concurrency():
    from vit_serve.predict.ray import model_stage

    kwargs = model_stage(3, {"num_gpus": 1, "num_cpus": 0})
    assert "concurrency" not in kwargs and kwargs["num_gpus"] == 1 and kwargs["num_cpus"] == 0
    strategy, logged = _resolve(**kwargs)
    assert isinstance(strategy, ray_data.ActorPoolStrategy)
    assert (strategy.min_size, strategy.max_size) == (3, 3)
    assert not [m for m in logged if "deprecated" in m], logged
    _, old = _resolve(concurrency=3)  # the form main used: what the check tells apart
    assert any("``concurrency`` is deprecated" in m for m in old), old
