"""Dynamic batching on the real gateway and model: concurrent requests run as one batch (the batch-size
histogram in /metrics and each answer's timing_ms.batch_size say so, and the numbers equal unbatched ones);
batching off runs them one by one; a full queue answers 503 + Retry-After; a slow answer 504.

To hold requests in the queue deterministically, the tests occupy the gateway's single model thread with a
task that waits on an event: the model runs one batch at a time, so nothing else runs until it is released.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from gateway_helpers import metric, run, serving, settings_for

JPEG = {"Content-Type": "image/jpeg"}


async def _classify_all(client, images: list[bytes]):
    return await asyncio.gather(*(client.post("/classify?top_k=10", content=d, headers=JPEG) for d in images))


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def _scores(r) -> dict[int, float]:
    return {p["index"]: p["score"] for p in r.json()["predictions"]}


def test_requests_queued_during_a_run_share_the_next_batch(tiny_ckpt, photos):
    images = [photos["coffee.jpg"], photos["chelsea.jpg"], photos["astronaut.png"]] * 3  # 9 requests

    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8, max_delay_ms=5)) as (client, app):
            gateway = app.state.gateway
            release = threading.Event()
            gateway.model().thread.submit(release.wait)  # the model is "running a batch" until released
            first = asyncio.create_task(client.post("/classify", content=images[8], headers=JPEG))
            await _wait_for(lambda: gateway.model().runner.running == 1)
            rest = asyncio.gather(*(client.post("/classify?top_k=10", content=d, headers=JPEG)
                                    for d in images[:8]))
            await _wait_for(lambda: gateway.model().runner.depth == 8)
            release.set()
            batched, first = await rest, await first
            text = (await client.get("/metrics")).text
        async with serving(settings_for(tiny_ckpt, max_batch=1)) as (client, _):
            alone = [await client.post("/classify?top_k=10", content=d, headers=JPEG) for d in images[:3]]
        return first, batched, text, alone

    first, batched, text, alone = run(scenario())
    assert first.status_code == 200 and first.json()["timing_ms"]["batch_size"] == 1
    assert all(r.status_code == 200 for r in batched)
    assert [r.json()["timing_ms"]["batch_size"] for r in batched] == [8] * 8
    assert metric(text, "vit_serve_batch_size_count", task="classify") == 2
    assert metric(text, "vit_serve_batch_size_sum", task="classify") == 9
    for r, ref in zip(batched[:3], alone, strict=True):  # rows of a batch get what they get alone
        a, b = _scores(r), _scores(ref)
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], atol=1e-6)


def test_concurrent_requests_coalesce(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=16, max_delay_ms=1000)) as (client, _):
            rs = await _classify_all(client, [photos["coffee.jpg"]] * 12)
            return rs, (await client.get("/metrics")).text

    rs, text = run(scenario())
    assert all(r.status_code == 200 for r in rs)
    batches = metric(text, "vit_serve_batch_size_count", task="classify")
    assert metric(text, "vit_serve_batch_size_sum", task="classify") == 12
    assert batches < 12  # 12 requests sent at once did not run one by one
    assert max(r.json()["timing_ms"]["batch_size"] for r in rs) > 1


def test_lone_request_does_not_wait_for_the_window(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=16, max_delay_ms=3000)) as (client, _):
            lone = await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
            three = await _classify_all(client, [photos["coffee.jpg"]] * 3)
            return lone, three

    lone, three = run(scenario())
    assert lone.json()["timing_ms"]["batch_size"] == 1
    assert lone.json()["timing_ms"]["queue"] < 1000  # nothing else was coming: no 3 s wait
    # Nothing more was coming once these three were queued (how they split depends on arrival order).
    assert all(r.json()["timing_ms"]["queue"] < 1000 for r in three)


def test_batch_waits_for_an_upload_in_progress_at_most_max_delay(tiny_ckpt, photos):
    data = photos["chelsea.jpg"]

    async def slow_body():  # a client still uploading: announced, not yet queued
        yield data[:1000]
        await asyncio.sleep(1.5)
        yield data[1000:]

    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=16, max_delay_ms=300)) as (client, app):
            slow = asyncio.create_task(client.post("/classify", content=slow_body(), headers=JPEG))
            await _wait_for(lambda: app.state.gateway.model().runner.incoming == 1)
            fast = await client.post("/classify", content=photos["coffee.jpg"], headers=JPEG)
            return fast, await slow

    fast, slow = run(scenario())
    assert fast.status_code == slow.status_code == 200
    timing = fast.json()["timing_ms"]
    assert timing["batch_size"] == 1  # the slow upload did not make it into the window
    assert 250 <= timing["queue"] < 1200  # waited for it, but only max_delay_ms
    assert slow.json()["timing_ms"]["batch_size"] == 1


def test_batching_off_runs_one_at_a_time(tiny_ckpt, photos):
    for kw in ({"max_batch": 1}, {"max_delay_ms": 0}):
        async def scenario(kw=kw):
            async with serving(settings_for(tiny_ckpt, **kw)) as (client, _):
                rs = await _classify_all(client, [photos["coffee.jpg"]] * 5)
                return rs, (await client.get("/metrics")).text

        rs, text = run(scenario())
        assert [r.json()["timing_ms"]["batch_size"] for r in rs] == [1] * 5
        assert metric(text, "vit_serve_batch_size_count", task="classify") == 5


def test_classify_and_explain_do_not_share_a_batch(tiny_ckpt, photos):
    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=8, max_delay_ms=300)) as (client, _):
            data = photos["coffee.jpg"]
            rs = await asyncio.gather(
                *(client.post("/classify", content=data, headers=JPEG) for _ in range(3)),
                *(client.post("/explain?format=json", content=data, headers=JPEG) for _ in range(2)))
            return rs, (await client.get("/metrics")).text

    rs, text = run(scenario())
    assert all(r.status_code == 200 for r in rs)
    assert metric(text, "vit_serve_batch_size_sum", task="classify") == 3
    assert metric(text, "vit_serve_batch_size_sum", task="explain") == 2
    assert metric(text, "vit_serve_batch_size_count", task="explain") == 1


def test_full_queue_answers_503_with_retry_after(tiny_ckpt, photos):
    data = photos["coffee.jpg"]

    async def scenario():
        async with serving(settings_for(tiny_ckpt, max_batch=1, max_queue=2, retry_after_s=3)) as (client, app):
            gateway = app.state.gateway
            release = threading.Event()
            gateway.model().thread.submit(release.wait)  # the model thread is busy until released
            post = lambda: client.post("/classify", content=data, headers=JPEG)  # noqa: E731
            first = asyncio.create_task(post())  # taken by the collector, waits for the model thread
            await _wait_for(lambda: gateway.model().runner.running == 1)
            queued = [asyncio.create_task(post()) for _ in range(2)]
            await _wait_for(lambda: gateway.model().runner.depth == 2)
            refused = await post()
            depth = metric((await client.get("/metrics")).text, "vit_serve_queue_depth")
            release.set()
            done = await asyncio.gather(first, *queued)
            return refused, depth, done, (await client.get("/metrics")).text

    refused, depth, done, text = run(scenario())
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "3"
    assert "queue full" in refused.json()["detail"]
    assert depth == 2
    assert [r.status_code for r in done] == [200, 200, 200]
    assert metric(text, "vit_serve_rejected_total", reason="queue_full") == 1
    assert metric(text, "vit_serve_requests_total", endpoint="/classify", method="POST", status="503") == 1


def test_request_timeout_answers_504_and_the_server_recovers(tiny_ckpt, photos):
    data = photos["coffee.jpg"]

    async def scenario():
        async with serving(settings_for(tiny_ckpt, request_timeout_s=0.3)) as (client, app):
            release = threading.Event()
            app.state.gateway.model().thread.submit(release.wait)
            slow = await client.post("/classify", content=data, headers=JPEG)
            release.set()
            after = await client.post("/classify", content=data, headers=JPEG)
            return slow, after, (await client.get("/metrics")).text

    slow, after, text = run(scenario())
    assert slow.status_code == 504
    assert "0.3 s" in slow.json()["detail"]
    assert after.status_code == 200
    assert metric(text, "vit_serve_rejected_total", reason="timeout") == 1
