"""Clients that hang up, with real clients against the gateway under a real uvicorn (gRPC port on): httpx requests
cancelled while queued, tritonclient.grpc's `async_infer(...).cancel()`, a tritonclient.grpc.aio call whose task is
cancelled, and tritonclient.http with a short `network_timeout` (it closes the connection). Each time the requests
are held in the queue behind the version's held model thread (`held_model.Gate`); once the gate opens, the model ran
none of the requests whose clients left (the batch_size histogram's sum in /metrics counts the images it ran, a
batch as it starts: the held one is counted at once), `vit_serve_cancelled_total{stage="queue"}` rose by exactly the
number cancelled, and every request whose client stayed was answered 200 (nothing else dropped). A client leaving
while its batch runs is counted once, at infer (by the runner that holds it, not again by the gateway)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from held_model import Counts, Gate, Live, hold, live_held, until

grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as grpcaio  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

JPEG = {"Content-Type": "image/jpeg"}


@pytest.fixture(scope="module")
def live(tiny_ckpt) -> Iterator[Live]:
    yield from live_held(tiny_ckpt)


def _pixels(live: Live, seed: int) -> np.ndarray:
    h, w = live.mv.info.resolution
    return np.random.default_rng(seed).standard_normal((1, 3, h, w)).astype(np.float32)


def test_httpx_clients_hanging_up_in_the_queue_are_dropped_and_counted(live, photos):
    """httpx: 6 of 10 queued clients cancel their requests (httpx closes their connections)."""
    leave_n, stay_n = 6, 4
    image = photos["coffee.jpg"]

    async def scenario():
        before = await Counts.of(live.url)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            gate, keeper = await hold(live, client, image)
            leaving, staying = [], []
            for i in range(leave_n + stay_n):  # interleaved, so that the stayers are spread through the queue
                task = asyncio.create_task(client.post(f"{live.url}/classify", content=image, headers=JPEG))
                (leaving if i % 5 in (0, 2, 4) and len(leaving) < leave_n else staying).append(task)
                n = i + 1
                await until(lambda n=n: live.mv.runner.depth == n)
            for task in leaving:
                task.cancel()
            await until(lambda: live.mv.runner.depth == stay_n)
            gone = await Counts.of(live.url)
            gate.open()
            answers = await asyncio.gather(keeper, *staying)
            for task in leaving:
                with pytest.raises(asyncio.CancelledError):
                    await task
        return before, gone, answers, await Counts.of(live.url)

    before, gone, answers, after = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * (1 + stay_n)
    assert gone.since(before) == {"rows": 1, "deadline": 0, "cancelled": leave_n, "cancelled_queue": leave_n}
    assert after.since(before) == {"rows": 1 + stay_n, "deadline": 0, "cancelled": leave_n,
                                   "cancelled_queue": leave_n}


def test_tritonclient_grpc_cancel_while_queued(live, photos):
    """tritonclient.grpc `async_infer(...).cancel()` and a tritonclient.grpc.aio call whose task is cancelled:
    both leave the queue unrun and are counted; the call beside them that nobody cancelled is answered."""

    async def scenario():
        before = await Counts.of(live.url)
        sync = grpcclient.InferenceServerClient(live.grpc)
        aio = grpcaio.InferenceServerClient(live.grpc)
        answers: dict[str, Any] = {}
        got = threading.Event()

        def callback(result, error) -> None:
            answers["sync"] = error if error is not None else result
            got.set()

        def inputs(module, seed: int) -> dict[str, Any]:  # logits only: one classify pass (no outputs: all)
            inp = module.InferInput("pixel_values", [1, 3, *live.mv.info.resolution], "FP32")
            inp.set_data_from_numpy(_pixels(live, seed))
            return {"inputs": [inp], "outputs": [module.InferRequestedOutput("logits")]}

        try:
            async with httpx.AsyncClient(timeout=60) as client:
                gate, keeper = await hold(live, client, photos["coffee.jpg"])
                call = sync.async_infer("tiny", callback=callback, **inputs(grpcclient, 1))
                await until(lambda: live.mv.runner.depth == 1)
                aio_call = asyncio.create_task(aio.infer("tiny", **inputs(grpcaio, 2)))
                await until(lambda: live.mv.runner.depth == 2)
                kept = asyncio.create_task(aio.infer("tiny", **inputs(grpcaio, 3)))
                await until(lambda: live.mv.runner.depth == 3)
                call.cancel()
                aio_call.cancel()
                await until(lambda: live.mv.runner.depth == 1)
                await until(got.is_set)
                gone = await Counts.of(live.url)
                gate.open()
                kept_logits = (await kept).as_numpy("logits")
                assert (await keeper).status_code == 200
                with pytest.raises(asyncio.CancelledError):
                    await aio_call
        finally:
            sync.close()
            await aio.close()
        return before, gone, answers["sync"], kept_logits, await Counts.of(live.url)

    before, gone, sync_answer, kept_logits, after = asyncio.run(scenario())
    assert isinstance(sync_answer, InferenceServerException) and "CANCELLED" in str(sync_answer.status())
    assert kept_logits.shape == (1, live.mv.info.num_classes)
    assert gone.since(before) == {"rows": 1, "deadline": 0, "cancelled": 2, "cancelled_queue": 2}
    assert after.since(before) == {"rows": 2, "deadline": 0, "cancelled": 2, "cancelled_queue": 2}


def test_tritonclient_http_network_timeout_hangs_up(live, photos):
    """tritonclient.http with `network_timeout=0.5`: the client gives up on a request waiting in the queue and
    closes its connection; the gateway drops it unrun and counts it, and answers the request beside it."""
    address = live.url.removeprefix("http://")

    async def scenario():
        before = await Counts.of(live.url)
        impatient = httpclient.InferenceServerClient(address, network_timeout=0.5)
        inp = httpclient.InferInput("pixel_values", [1, 3, *live.mv.info.resolution], "FP32")
        inp.set_data_from_numpy(_pixels(live, 4), binary_data=True)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                gate, keeper = await hold(live, client, photos["coffee.jpg"])
                kept = asyncio.create_task(client.post(f"{live.url}/classify", content=photos["chelsea.jpg"],
                                                       headers=JPEG))
                await until(lambda: live.mv.runner.depth == 1)
                giving_up = asyncio.create_task(asyncio.to_thread(_give_up, impatient, inp))
                await until(lambda: live.mv.runner.depth == 2)
                error = await giving_up
                await until(lambda: live.mv.runner.depth == 1)  # the impatient one left; `kept` still waits
                gone = await Counts.of(live.url)
                gate.open()
                codes = [(await keeper).status_code, (await kept).status_code]
        finally:
            impatient.close()
        return before, gone, error, codes, await Counts.of(live.url)

    before, gone, error, codes, after = asyncio.run(scenario())
    assert "timed out" in str(error).lower() or "timeout" in type(error).__name__.lower(), repr(error)
    assert codes == [200, 200]
    assert gone.since(before) == {"rows": 1, "deadline": 0, "cancelled": 1, "cancelled_queue": 1}
    assert after.since(before) == {"rows": 2, "deadline": 0, "cancelled": 1, "cancelled_queue": 1}


def _give_up(client, inp) -> BaseException:
    """tritonclient.http's blocking infer, which must fail by its network timeout; the error it raised."""
    try:
        client.infer("tiny", [inp], outputs=[httpclient.InferRequestedOutput("logits", binary_data=True)])
    except Exception as e:  # geventhttpclient's timeout, or tritonclient's wrapping of it
        return e
    raise AssertionError("the request was answered although the model was held")


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_client_leaving_while_its_batch_runs_is_counted_once_at_infer(live, photos, transport):
    """A request already in the running batch (the model thread held) whose client leaves (httpx hangs up; a
    tritonclient.grpc.aio call's task is cancelled): the runner that holds it counts it, at infer, and the
    gateway does not count it again; its batch still runs (its answer thrown away)."""

    async def scenario():
        before = await Counts.of(live.url)
        aio = grpcaio.InferenceServerClient(live.grpc)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                gate = Gate(live.mv)
                gate.close()
                if transport == "http":
                    leaving = asyncio.create_task(client.post(f"{live.url}/classify", content=photos["coffee.jpg"],
                                                              headers=JPEG))
                else:
                    inp = grpcaio.InferInput("pixel_values", [1, 3, *live.mv.info.resolution], "FP32")
                    inp.set_data_from_numpy(_pixels(live, 5))
                    leaving = asyncio.create_task(aio.infer("tiny", [inp],
                                                            outputs=[grpcaio.InferRequestedOutput("logits")]))
                await until(lambda: live.mv.runner.running == 1)
                leaving.cancel()
                for _ in range(2000):  # until it is counted (the hang-up reaches the gateway)
                    gone = await Counts.of(live.url)
                    if gone.since(before)["cancelled"]:
                        break
                    await asyncio.sleep(0.01)
                gate.open()
                await until(lambda: live.mv.runner.running == 0)
                with pytest.raises(asyncio.CancelledError):
                    await leaving
        finally:
            await aio.close()
        return before, gone, await Counts.of(live.url)

    before, gone, after = asyncio.run(scenario())
    assert gone.since(before) == {"rows": 1, "deadline": 0, "cancelled": 1, "cancelled_infer": 1}
    assert after.since(before) == {"rows": 1, "deadline": 0, "cancelled": 1, "cancelled_infer": 1}
