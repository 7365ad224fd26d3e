"""Model instances (`RunnerLimits.instances`, Triton's instance_group count) on the real gateway and torch
backend: n instances run n batches at once, one instance one at a time, and the answers are the model's own.

Concurrency is seen from inside the model: a forward pre-hook on the served torch module waits at a two-party
barrier, which two batches pass only when they are in the model at the same time.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch
from gateway_helpers import run, serving, settings_for

from vit_serve.runtime.task import CLASSIFY
from vit_serve.serve.admission import Admission

BARRIER_S = 3.0


def _x(mv, i: int) -> np.ndarray:
    h, w = mv.info.resolution
    return np.random.default_rng(i).standard_normal((1, 3, h, w)).astype(np.float32)


def _two_batches_at_a_barrier(tiny_ckpt, instances: int):
    """Two one-image requests (batches of one) while the model waits at a two-party barrier: their results (or
    errors), the runner's instances, /models' batching, and the logits of the same images run directly."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1, instances=instances)) as (client, app):
            mv = app.state.gateway.model()
            barrier = threading.Barrier(2, timeout=BARRIER_S)

            def meet(*_) -> None:  # returns None: a pre-hook's value would replace the model's input
                barrier.wait()

            handle = mv.backend.model.register_forward_pre_hook(meet)
            try:
                results = await asyncio.gather(*(mv.infer(CLASSIFY, _x(mv, i), None, Admission()) for i in range(2)),
                                               return_exceptions=True)
            finally:
                handle.remove()
            with torch.inference_mode():
                direct = [mv.backend.model(torch.from_numpy(_x(mv, i))).numpy() for i in range(2)]
            body = (await client.get("/models")).json()
            return results, mv.runner.instances, body["models"][0]["versions"][0]["batching"], direct

    return run(scenario())


def test_two_instances_run_two_batches_at_once_with_the_models_answers(tiny_ckpt):
    results, instances, batching, direct = _two_batches_at_a_barrier(tiny_ckpt, instances=2)
    assert instances == 2 and batching["instances"] == 2
    for result, want in zip(results, direct, strict=True):
        assert not isinstance(result, BaseException), result
        assert result.batch_size == 1
        np.testing.assert_allclose(result.outputs["logits"], want, rtol=1e-5, atol=1e-5)


def test_one_instance_runs_one_batch_at_a_time(tiny_ckpt):
    results, instances, batching, _ = _two_batches_at_a_barrier(tiny_ckpt, instances=1)
    assert instances == 1 and batching["instances"] == 1
    # the first batch waits alone at the barrier until it breaks; the second then finds it broken
    assert all(isinstance(r, threading.BrokenBarrierError) for r in results), results
