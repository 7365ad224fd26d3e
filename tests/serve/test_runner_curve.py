"""The gateway's batcher and its model's batch curve (`vit_serve.runtime.batch_curve`), on the real gateway and
model: the curve is measured at warm-up and shown by /models; where it says batching does not pay (a CPU where
batch 1 is as fast per image as batch 8) the batcher runs what is queued one image at a time and never waits for
a batch to fill; where it pays, it batches and waits as configured.

As in test_batching, requests are held in the queue by occupying the version's single model thread.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from gateway_helpers import run, serving, settings_for
from held_model import until

from vit_serve.runtime.batch_curve import BatchCurve
from vit_serve.runtime.task import CLASSIFY
from vit_serve.serve.admission import Admission

FLAT = {1: 1 / 34.7, 2: 1 / 34.5, 4: 1 / 34.4, 8: 1 / 33.9}  # s an image: onnxruntime ViT-S/16, 2 AVX-512 cores
GAINS = {1: 1 / 400, 2: 1 / 790, 4: 1 / 1500, 8: 1 / 2900}  # a GPU's


def _x(mv, i: int) -> np.ndarray:
    h, w = mv.info.resolution
    return np.random.default_rng(i).standard_normal((1, 3, h, w)).astype(np.float32)


def test_the_curve_is_measured_at_warm_up_and_shown_by_models(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8, batch_curve=True)) as (client, app):
            runner = app.state.gateway.model().runner
            body = (await client.get("/models")).json()
            return runner.curve, runner.max_batch, runner.delay_s, body

    curve, max_batch, delay_s, body = run(scenario())
    assert curve is not None and sorted(curve.per_image_s) == [1, 2, 4, 8]
    assert max_batch == curve.limit <= 8
    assert (delay_s > 0) == curve.worth_waiting
    (version,) = body["models"][0]["versions"]
    shown = version["batching"]
    assert shown["max_batch"] == max_batch and shown["max_delay_ms"] == delay_s * 1e3
    assert {int(b): r for b, r in shown["images_per_s"].items()} == {
        b: 1 / s for b, s in sorted(curve.per_image_s.items())}


def test_off_batches_as_configured_and_shows_no_curve(tiny_ckpt):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8)) as (client, app):
            return app.state.gateway.model().runner.curve, (await client.get("/models")).json()

    curve, body = run(scenario())
    assert curve is None
    assert body["models"][0]["versions"][0]["batching"] == {"max_batch": 8, "max_delay_ms": 5.0, "images_per_s": {},
                                                                 "instances": 1}


def _queued_batches(tiny_ckpt, per_image_s: dict[int, float]) -> list[int]:
    """Six requests queued while a first one runs on a held model thread, then released: the batch size each of
    the six was answered in."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8)) as (_, app):
            mv = app.state.gateway.model()
            mv.runner.use_curve(BatchCurve(8, per_image_s))
            gate = threading.Event()
            mv.thread.submit(gate.wait)
            try:
                first = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 99), None, Admission()))
                await until(lambda: mv.runner.running == 1)
                tasks = [asyncio.create_task(mv.infer(CLASSIFY, _x(mv, i), None, Admission())) for i in range(6)]
                await until(lambda: mv.runner.depth == 6)
            finally:
                gate.set()
            await first
            return [r.batch_size for r in await asyncio.gather(*tasks)]

    return run(scenario())


def test_a_flat_curve_runs_queued_requests_one_by_one(tiny_ckpt):
    assert _queued_batches(tiny_ckpt, FLAT) == [1] * 6


def test_a_curve_with_gains_runs_them_as_one_batch(tiny_ckpt):
    assert _queued_batches(tiny_ckpt, GAINS) == [6] * 6


def _waits_for_an_arrival(tiny_ckpt, per_image_s: dict[int, float]) -> bool:
    """A lone request while another is announced (its body being read), max_delay_ms 5 s: whether the batcher
    held the request back for it (still unanswered 0.5 s later, answered once the other stops coming)."""
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8, max_delay_ms=5000)) as (_, app):
            mv = app.state.gateway.model()
            mv.runner.use_curve(BatchCurve(8, per_image_s))
            coming = mv.runner.arriving()
            task = asyncio.create_task(mv.infer(CLASSIFY, _x(mv, 0), None, Admission()))
            done, _ = await asyncio.wait([task], timeout=0.5)
            coming.done()
            result = await asyncio.wait_for(task, 10)
            assert result.batch_size == 1
            return not done

    return run(scenario())


def test_a_flat_curve_never_waits_for_a_batch_to_fill(tiny_ckpt):
    assert not _waits_for_an_arrival(tiny_ckpt, FLAT)


def test_a_curve_with_gains_waits_for_what_is_coming(tiny_ckpt):
    assert _waits_for_an_arrival(tiny_ckpt, GAINS)
